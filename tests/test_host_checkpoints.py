"""Checkpoints a trainer writes on another host than the driver's (`resume/store.py` in that host's
run folder), shipped by the run-file mirror (`launch/run_files.py`): a part reaches the driver's
folder with its manifest last (never complete there before it is whole), staging folders stay on
the host, and the driver keeps the `checkpoint.keep` newest checkpoints the trainers keep (also when
they are on two hosts, where neither host's prune finds a complete one)."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from types import SimpleNamespace

from stream_rlhf.launch.run_files import SHIPPING, FileChange, FolderMirror, apply_changes
from stream_rlhf.resume.store import MANIFEST, CheckpointStore

PARTS = ["actor", "critic"]
ENGINE_BYTES = 10_000


def ship(mirror: FolderMirror, driver: Path, max_bytes: int = 32 << 20) -> int:
    """Every change so far, in calls of at most `max_bytes`; the calls it took."""
    calls = 0
    while changes := mirror.changes(max_bytes):
        apply_changes(driver, changes)
        calls += 1
    return calls


def write(store: CheckpointStore, version: int, part: str, during=None) -> None:
    def fill(folder: Path) -> None:
        (folder / "engine.pt").write_bytes(bytes([version]) * ENGINE_BYTES)
        (folder / "state.json").write_text(f'{{"version": {version}}}')
        if during is not None:
            during()

    store.write_part(version, part, fill)


def iter_folders(root: Path) -> list[str]:
    return sorted(p.name for p in root.glob("iter-*"))


def test_a_part_arrives_whole_with_its_manifest_last_and_its_staging_folder_never(tmp_path, caplog):
    host, driver = tmp_path / "host" / "run", tmp_path / "driver" / "run"
    (host / "checkpoints").mkdir(parents=True)
    mirror = FolderMirror(host)
    store, copy = CheckpointStore(host / "checkpoints", keep=2), CheckpointStore(driver / "checkpoints", keep=2)
    # the mirror scans while the part is still in its staging folder: nothing of it is sent
    write(store, 1, "actor", during=lambda: ship(mirror, driver))
    assert not (driver / "checkpoints").exists() or not list((driver / "checkpoints").rglob("*.tmp"))
    write(store, 1, "critic")
    calls = 0
    with caplog.at_level(logging.WARNING):
        while changes := mirror.changes(max_bytes=4096):  # engine.pt takes three calls
            apply_changes(driver, changes)
            calls += 1
            complete = copy.versions(PARTS)
            assert complete in ([], [1])
            if complete:  # complete in the driver's folder means intact there
                assert (point := copy.latest(PARTS)) is not None and point.version == 1
    assert calls >= 5 and copy.versions(PARTS) == [1] and "damaged" not in caplog.text
    for part in PARTS:
        assert (driver / "checkpoints" / "iter-000001" / part / "engine.pt").read_bytes() == bytes([1]) * ENGINE_BYTES
    assert not list(driver.rglob(f"*{SHIPPING}")) and not list(driver.rglob("*.tmp"))


def test_the_driver_keeps_the_checkpoints_the_trainers_host_keeps_after_its_prune(tmp_path):
    host, driver = tmp_path / "host" / "run", tmp_path / "driver" / "run"
    (host / "checkpoints").mkdir(parents=True)
    mirror = FolderMirror(host)
    store, copy = CheckpointStore(host / "checkpoints", keep=2), CheckpointStore(driver / "checkpoints", keep=2)
    for version in range(1, 5):
        for part in PARTS:
            write(store, version, part)
        store.prune(PARTS)  # as the trainer does after each save
        ship(mirror, driver, max_bytes=8192)
        assert iter_folders(driver / "checkpoints") == iter_folders(host / "checkpoints")
    assert iter_folders(driver / "checkpoints") == ["iter-000003", "iter-000004"]
    assert copy.versions(PARTS) == [3, 4] and copy.latest(PARTS).version == 4


def test_a_file_deleted_before_it_was_all_sent_leaves_no_shipping_copy(tmp_path):
    host, driver = tmp_path / "host" / "run", tmp_path / "driver" / "run"
    (host / "checkpoints").mkdir(parents=True)
    mirror = FolderMirror(host)
    store = CheckpointStore(host / "checkpoints", keep=1)
    write(store, 1, "actor")
    apply_changes(driver, mirror.changes(max_bytes=4096))  # a first piece of engine.pt only
    assert list(driver.rglob(f"*{SHIPPING}"))
    assert not (driver / "checkpoints" / "iter-000001" / "actor" / MANIFEST).exists()
    write(store, 2, "actor")
    store.prune(["actor"])  # iter-000001 goes before it was all sent
    ship(mirror, driver)
    assert iter_folders(driver / "checkpoints") == ["iter-000002"] and not list(driver.rglob(f"*{SHIPPING}"))
    assert CheckpointStore(driver / "checkpoints").latest(["actor"]).version == 2
    # the rest of a file whose folder the driver pruned meanwhile is dropped, not written
    rest = FileChange("checkpoints/iter-000001/actor/engine.pt", 4096, b"rest", whole=True)
    assert apply_changes(driver, [rest]) == 0 and iter_folders(driver / "checkpoints") == ["iter-000002"]


def test_trainers_on_two_hosts_the_drivers_copy_is_pruned_as_their_prunes_recorded(tmp_path):
    """actor_train and critic_train on two hosts, neither the driver's: each host's folder holds one
    part, so neither prune finds a complete checkpoint there; the driver prunes its copy (and
    rollout's kept outputs, from a third host) as the trainers' prunes recorded."""
    from stream_rlhf.launch.ray_hosts import RayHosts

    driver = tmp_path / "driver" / "run"
    driver.mkdir(parents=True)
    plan = SimpleNamespace(run_dir=str(driver), flow=SimpleNamespace(trace_folder=None))
    hosts = RayHosts(plan, driver_host="driver")
    folders = {host: tmp_path / host / "run" for host in ("actor-host", "critic-host", "rollout-host")}
    for folder in folders.values():
        (folder / "checkpoints").mkdir(parents=True)
    mirrors = {host: FolderMirror(folder) for host, folder in folders.items()}
    generated = folders["rollout-host"] / "checkpoints" / "generated"
    generated.mkdir()
    for version in range(1, 5):
        (generated / f"{version - 1:06d}-0000-8.pt").write_bytes(b"kept outputs")  # iteration version - 1
        for part, host in (("actor", "actor-host"), ("critic", "critic-host")):
            store = CheckpointStore(folders[host] / "checkpoints", keep=2)
            write(store, version, part)
            store.prune(PARTS)  # as the trainer does: nothing is complete on its host
        for host, mirror in mirrors.items():
            while changes := mirror.changes(8192):
                hosts._apply(host, changes)
    assert len(iter_folders(folders["actor-host"] / "checkpoints")) == 4  # the hosts' prunes found nothing
    assert iter_folders(driver / "checkpoints") == ["iter-000003", "iter-000004"]
    assert CheckpointStore(driver / "checkpoints").latest(PARTS).version == 4
    # checkpoint 3 holds iterations 0 to 2: of rollout's outputs only iteration 3's are still needed
    assert [p.name for p in (driver / "checkpoints" / "generated").iterdir()] == ["000003-0000-8.pt"]


def test_a_resumed_ranks_inputs_reach_its_host_and_only_what_the_host_changes_comes_back(tmp_path):
    """`RayHosts.relocate` of a resumed run: the named paths of the driver's run folder (a part of
    the resume checkpoint, the metrics the trainer continues) reach the host's run folder in
    several calls, nothing else does, and the host's mirror ships back only what changes there:
    appended metrics as an append, a new checkpoint."""
    from stream_rlhf.launch.ray_hosts import _HostActor

    driver = tmp_path / "run"
    store = CheckpointStore(driver / "checkpoints")
    for version in (2, 4):
        for part in PARTS:
            write(store, version, part)
    (driver / "metrics.jsonl").write_text('{"iteration": 0}\n{"iteration": 1}\n')
    (driver / "summary.json").write_text("{}")
    host = _HostActor()
    host_run = Path(host.open("run", None))
    try:
        inputs = FolderMirror(driver, ["checkpoints/iter-000004/actor", "metrics.jsonl", "checkpoints/generated"])
        calls = 0
        while changes := inputs.changes(4096):  # an engine file takes 3 calls
            host.receive(changes)
            calls += 1
        assert calls >= 3
        got = sorted(p.relative_to(host_run).as_posix() for p in host_run.rglob("*") if p.is_file())
        assert got == ["checkpoints/iter-000004/actor/MANIFEST.json", "checkpoints/iter-000004/actor/engine.pt",
                       "checkpoints/iter-000004/actor/state.json", "metrics.jsonl"]
        point = CheckpointStore(host_run / "checkpoints").latest(["actor"])  # whole and verified there
        assert point is not None and point.version == 4
        assert host.changes(1 << 20) == []  # what came from the driver does not go back
        with (host_run / "metrics.jsonl").open("a") as f:
            f.write('{"iteration": 2}\n')
        write(CheckpointStore(host_run / "checkpoints"), 6, "actor")
        changes = host.changes(1 << 20)
        assert [(c.path, c.offset, c.whole) for c in changes if c.path == "metrics.jsonl"] == [
            ("metrics.jsonl", len('{"iteration": 0}\n{"iteration": 1}\n'), False)]
        assert {c.path for c in changes} - {"metrics.jsonl"} == {
            f"checkpoints/iter-000006/actor/{name}" for name in ("MANIFEST.json", "engine.pt", "state.json")}
        apply_changes(driver, changes)
        assert (driver / "metrics.jsonl").read_text().count("iteration") == 3
        assert store.versions(["actor"]) == [2, 4, 6]
    finally:
        shutil.rmtree(host.root)
