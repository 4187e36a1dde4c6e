"""Across hosts without Ray: payloads fetched from another host's payload server over TCP with the
job's CURVE keys (a stranger's keys or none are rejected), the frame limits, the keys in memory,
and the plan of a job that spans hosts (keys made by the driver, weights by broadcast under
`ray.node_hosts`, refused without keys)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from stream_rlhf.broker import sockets
from stream_rlhf.broker.control.messages import FieldSpec, Handle, Location
from stream_rlhf.broker.payload.server import PayloadError
from stream_rlhf.broker.payload.transport import FRAME_BYTES, ShmTransport
from stream_rlhf.config import ConfigError, build
from stream_rlhf.driver.plan import preview_plan
from stream_rlhf.launch.spec import StageSpec
from stream_rlhf.rl.config import RLJobConfig
from tests.rl_tiny import tiny_job


@pytest.fixture
def keys(tmp_path: Path) -> str:
    return str(sockets.CurveKeys.generate().write(tmp_path / "keys"))


def transport_on(host: str, monkeypatch, **kwargs) -> ShmTransport:
    monkeypatch.setenv("STREAM_RLHF_HOST_ID", host)
    return ShmTransport(prefix="across", **kwargs)


def handle_of(producer: ShmTransport, handle_id: str, tensors: dict[str, torch.Tensor]) -> Handle:
    return Handle(handle_id, "rollout", 0, 0, 0, 1, fields=producer.put(handle_id, tensors), producer="rollout-0")


def test_a_consumer_on_another_host_fetches_over_tcp_with_the_jobs_keys(keys, monkeypatch):
    producer = transport_on("host-a", monkeypatch, key_dir=keys)
    same_host = transport_on("host-a", monkeypatch, serve=False, key_dir=keys)
    other_host = transport_on("host-b", monkeypatch, serve=False, key_dir=keys)
    try:
        big = torch.arange(100_000, dtype=torch.float32)  # a segment of its own: sent zero-copy
        small = torch.tensor([[1, 2], [3, 4]])  # an arena slot: copied into the message
        handle = handle_of(producer, "h1", {"logp": big, "tokens": small})
        fetched = other_host.get(handle)
        assert torch.equal(fetched["logp"], big) and torch.equal(fetched["tokens"], small)
        assert other_host.counters == {"payload.fetched_tcp": 1, "payload.fetched_tcp_bytes": 400_000 + 32}
        assert torch.equal(same_host.get(handle)["logp"], big)  # mapped from /dev/shm, not fetched
        assert same_host.counters == {}
        assert producer.endpoint.startswith("tcp://127.0.0.1:")
    finally:
        for transport in (other_host, same_host, producer):
            transport.close()


def test_a_joined_handle_is_fetched_from_its_parts_producers_under_their_own_ids(keys, monkeypatch):
    """A join's handle has an id of its own and may rename its parts' fields: each producer serves
    the field it holds where the location says, not by the joined handle's id and names."""
    rollout = transport_on("host-a", monkeypatch, key_dir=keys)
    reward = transport_on("host-c", monkeypatch, key_dir=keys)
    consumer = transport_on("host-b", monkeypatch, serve=False, key_dir=keys)
    try:
        tokens, scores = torch.arange(50_000), torch.tensor([0.5, 1.0])
        parts = {**rollout.put("part-1", {"tokens": tokens}),
                 "reward.scores": reward.put("part-2", {"scores": scores})["scores"]}
        joined = Handle("joined", "experience", 0, 0, 0, 2, fields=parts, parents=["part-1", "part-2"])
        fetched = consumer.get(joined)
        assert torch.equal(fetched["tokens"], tokens) and torch.equal(fetched["reward.scores"], scores)
        assert consumer.counters["payload.fetched_tcp"] == 1
        rollout.release("part-1")
        with pytest.raises(PayloadError, match=r"field 'tokens': nothing held here at .*\+0 \(released"):
            consumer.get(joined)
    finally:
        for transport in (consumer, reward, rollout):
            transport.close()


def test_a_stranger_or_a_plaintext_consumer_gets_nothing_from_a_curve_payload_server(keys, tmp_path, monkeypatch):
    stranger = str(sockets.CurveKeys.generate().write(tmp_path / "stranger"))
    producer = transport_on("host-a", monkeypatch, key_dir=keys)
    try:
        handle = handle_of(producer, "h1", {"x": torch.ones(10)})
        for key_dir in (stranger, None):
            consumer = transport_on("host-b", monkeypatch, serve=False, key_dir=key_dir, fetch_timeout_s=1)
            try:
                with pytest.raises(PayloadError, match="did not answer in 1 s"):
                    consumer.get(handle)
                assert consumer.counters == {}
            finally:
                consumer.close()
        assert producer.held() == 1  # served to no one, still there for the job's own consumers
    finally:
        producer.close()


def test_a_field_over_the_frame_limit_fails_by_name_before_any_fetch(monkeypatch):
    consumer = transport_on("host-b", monkeypatch, serve=False)
    where = Location("shm", "/x", 0, "host-a", "tcp://127.0.0.1:1")
    spec = FieldSpec("uint8", [FRAME_BYTES + 1], FRAME_BYTES + 1, where)
    try:
        with pytest.raises(PayloadError, match=r"field 'x': 1,073,741,825 bytes, over the 1,073,741,824"):
            consumer.get(Handle("h1", "rollout", 0, 0, 0, 1, fields={"x": spec}))
    finally:
        consumer.close()


def test_a_payload_server_beyond_loopback_needs_keys():
    with pytest.raises(sockets.CurveKeyError, match="payload server address tcp://0.0.0.0:0 is not loopback"):
        ShmTransport(prefix="across", serve_host="0.0.0.0")


def test_keys_in_memory_write_the_folder_layout_and_never_print_their_secrets(tmp_path):
    keys = sockets.CurveKeys.generate()
    assert "secret" not in repr(keys) and "private" not in repr(keys)
    with sockets.private_key_dir(keys) as folder:
        assert sockets.CurveKeys.read(folder) == keys
        assert (Path(folder) / "authorized_clients" / "client.key").read_bytes() == keys.files["client.key"]
        assert Path(folder).stat().st_mode & 0o077 == 0
    assert not Path(folder).exists()
    with pytest.raises(sockets.CurveKeyError, match="broker.key not found"):
        sockets.CurveKeys.read(tmp_path)


def test_interface_towards_the_broker():
    assert sockets.interface_towards("tcp://127.0.0.1:5555") == "127.0.0.1"
    assert sockets.interface_towards("ipc:///tmp/broker") == "127.0.0.1"
    with pytest.raises(ConfigError, match="tcp://no-such-host.invalid:5555: no route to its host"):
        sockets.interface_towards("tcp://no-such-host.invalid:5555")


def across(tmp_path: Path, **ray) -> RLJobConfig:
    return build(RLJobConfig, tiny_job(tmp_path, "across", launcher="ray", ray=ray))


PINNED = {"rollout": {"rollout_node": 1}, "actor_train": {"train_node": 1}}


def test_a_plan_across_hosts_carries_keys_made_by_the_driver_and_never_prints_them(tmp_path):
    assert preview_plan(across(tmp_path)).keys is None  # a local Ray instance: one host
    plan = preview_plan(across(tmp_path, address="127.0.0.1:6379"))
    assert plan.spans_hosts and plan.keys is not None and set(plan.keys.files) == set(sockets.KEY_FILES)
    assert plan.as_dict()["broker"]["curve"] is True
    text = json.dumps(plan.as_dict()) + plan.describe() + repr(plan)
    secrets = [content.split(b'secret-key = "')[1][:40].decode() for name, content in plan.keys.files.items()
               if name.endswith("_secret")]
    assert len(secrets) == 2 and not [secret for secret in secrets if secret in text]
    assert "CURVE keys the driver made for this run" in plan.describe()
    # a real cluster keeps the store: its ranks run on the driver's machine
    assert plan.flow.stages["rollout"].kwargs["job"].config.weights.transport == "shm"
    given = str(sockets.generate_keys(tmp_path / "given"))
    plan = preview_plan(build(RLJobConfig, tiny_job(tmp_path, "given", launcher="ray", ray={"address": "auto"},
                                                    broker={"curve": {"key_dir": given}})))
    assert plan.keys == sockets.CurveKeys.read(given)


def test_node_hosts_send_the_weights_by_broadcast_unless_rollout_and_training_share_nodes(tmp_path):
    plan = preview_plan(across(tmp_path, node_hosts=True, stage_resources=PINNED))
    rollout = plan.flow.stages["rollout"]
    assert rollout.kwargs["job"].config.weights.transport == "broadcast" and rollout.restarts == 2  # it rejoins
    assert any("weights.transport shm -> broadcast" in check for check in plan.checks)
    together = {"rollout": {"n": 1}, "actor_train": {"n": 1}}
    plan = preview_plan(across(tmp_path, node_hosts=True, stage_resources=together))
    assert plan.flow.stages["rollout"].kwargs["job"].config.weights.transport == "shm"
    cfg = build(RLJobConfig, tiny_job(tmp_path, "across", launcher="ray", restarts={"rollout": 1},
                                      ray={"node_hosts": True, "stage_resources": PINNED}))
    assert preview_plan(cfg).flow.stages["rollout"].restarts == 1  # once refused: a restart could not rejoin


def test_a_plan_across_hosts_without_keys_is_refused_before_anything_starts(tmp_path):
    pytest.importorskip("ray", reason="the ray extra is not installed")
    from dataclasses import replace

    from stream_rlhf.launch.ray_job import RayJob

    plan = preview_plan(across(tmp_path, node_hosts=True, stage_resources=PINNED))
    with pytest.raises(ConfigError, match="spans hosts .* but carries no CURVE keys"):
        RayJob(replace(plan, keys=None))


def test_a_host_run_folder_reaches_the_driver_appends_live_whole_files_replaced_deletions_too(tmp_path):
    """What ranks on another host write (metrics appended line by line, stage counts replaced, a
    checkpoint written in several pieces, files removed) arrives in the driver's run folder exactly."""
    from stream_rlhf.launch.run_files import FolderMirror, apply_changes

    host, driver = tmp_path / "host" / "run", tmp_path / "driver" / "run"
    host.mkdir(parents=True)
    mirror = FolderMirror(host)
    metrics = host / "metrics.jsonl"
    metrics.write_text('{"iteration": 1}\n')
    (host / "stage_counts").mkdir()
    counts = host / "stage_counts" / "rollout-0-7.json"
    counts.write_text('{"generated": 16}')
    assert apply_changes(driver, mirror.changes()) == len('{"iteration": 1}\n') + len('{"generated": 16}')
    assert mirror.changes() == []  # nothing changed since
    with metrics.open("a") as f:
        f.write('{"iteration": 2}\n')
    partial = counts.with_suffix(".partial")
    partial.write_text('{"generated": 32}')
    partial.replace(counts)
    changes = mirror.changes()
    appended = next(c for c in changes if c.path == "metrics.jsonl")
    assert (appended.whole, appended.offset, appended.data) == (False, 17, b'{"iteration": 2}\n')
    apply_changes(driver, changes)
    assert (driver / "metrics.jsonl").read_text() == '{"iteration": 1}\n{"iteration": 2}\n'
    assert (driver / "stage_counts" / "rollout-0-7.json").read_text() == '{"generated": 32}'
    metrics.write_text('{"iteration": 1, "cut": true}\n{"iteration": 2}\n')  # rewritten in place: sent whole
    weights = host / "checkpoint" / "model.safetensors"
    weights.parent.mkdir()
    weights.write_bytes(bytes(range(256)) * 40)  # 10,240 bytes in pieces of at most 4,096, metrics in the last
    pieces = 0
    while changes := mirror.changes(max_bytes=4096):
        pieces += 1
        apply_changes(driver, changes)
        if pieces == 1:  # a reader never sees half a file
            assert not (driver / "checkpoint" / "model.safetensors").exists()
    assert pieces == 3 and (driver / "checkpoint" / "model.safetensors").read_bytes() == weights.read_bytes()
    assert (driver / "metrics.jsonl").read_text() == metrics.read_text()
    counts.unlink()
    apply_changes(driver, mirror.changes())
    assert sorted(p.name for p in driver.rglob("*") if p.is_file()) == ["metrics.jsonl", "model.safetensors"]
    with pytest.raises(ValueError, match="outside it"):
        from stream_rlhf.launch.run_files import FileChange

        apply_changes(driver, [FileChange("../escape", 0, b"x", whole=True)])


def test_broadcast_groups_meet_through_a_store_instead_of_a_folder():
    """Across hosts a sender publishes its group's address in the launcher's store (no shared
    folder), binds its interface towards that store, and its receiver finds it there."""
    from stream_rlhf.weights import address_book
    from stream_rlhf.weights.broadcast import BroadcastReceiver, BroadcastSender
    from stream_rlhf.weights.group import WeightSyncTimeout

    store, book = address_book.host_book("127.0.0.1")
    assert book.startswith("tcp://127.0.0.1:") and address_book.sender_host(book) == "127.0.0.1"
    with pytest.raises(WeightSyncTimeout, match="'rollout-0': its address never appeared in the store"):
        address_book.lookup(book, "rollout-0", timeout_s=0.2)
    sender = BroadcastSender(book, {"rollout-0": 2}, "gloo", 1 << 20, timeout_s=30.0,
                             host=address_book.sender_host(book))
    try:
        # what a Path makes of the book (vLLM workers get it as a folder argument) is the same book
        receiver = BroadcastReceiver.join(Path(book), "rollout-0", 1, 2, "gloo", timeout_s=30.0)
        sender.publish([("w", torch.arange(6.0))], version=3)
        version, named = receiver.receive(min_version=3)
        assert version == 3 and torch.equal(dict(named)["w"], torch.arange(6.0))
        assert address_book.lookup(book, "rollout-0", 1.0).address.startswith("127.0.0.1:")
        receiver.close()
    finally:
        sender.close()
    assert not store.check(["address/rollout-0"])  # the sender forgot its address when it stopped


def test_a_rank_on_another_host_writes_its_run_folder_and_weights_there(tmp_path):
    """`on_host`: the plan's relocation of a stage spec; the trace and counts folders move with it,
    and stages that meet through one host's weight store are listed to share a host."""
    from stream_rlhf.driver.plan import on_host

    plan = preview_plan(across(tmp_path, node_hosts=True, stage_resources=PINNED))
    assert plan.run_dir == str((tmp_path / "across").resolve()) and plan.relocate == "stream_rlhf.driver.plan:on_host"
    spec = plan.flow.stages["actor_train"]
    moved = on_host(spec, str(tmp_path / "host" / "across"), "/dev/shm/x-weights-h1")
    job = moved.kwargs["job"]
    assert job.run_dir == tmp_path / "host" / "across" and job.weights_root == "/dev/shm/x-weights-h1"
    assert spec.kwargs["job"].run_dir == tmp_path / "across"  # the driver's spec is unchanged
    assert plan.same_host == []  # the critic crosses hosts by broadcast; the policy too here
    assert plan.flow.stages["critic_forward"].restarts == 2  # a restarted one joins the critic's group anew
    shm = preview_plan(across(tmp_path, node_hosts=True, stage_resources={"rollout": {"n": 1},
                                                                          "actor_train": {"n": 1}}))
    assert ("rollout", "actor_train") in [pair[:2] for pair in shm.same_host]
    with pytest.raises(ValueError, match="not named after job across"):
        on_host(spec, str(tmp_path / "host" / "other"), None)


def test_a_resumed_rank_on_another_host_reads_its_checkpoint_there_and_is_sent_what_it_reads(tmp_path):
    """A resumed run's ranks on another host (no longer refused): `on_host` points their resume at
    that host's run folder, and `resume_inputs` (the plan's `host_inputs`) names what each stage
    reads of the driver's, which the launcher copies there first."""
    from stream_rlhf.driver.plan import on_host
    from stream_rlhf.driver.resume import resume_inputs
    from stream_rlhf.resume.store import ResumePoint

    plan = preview_plan(across(tmp_path, node_hosts=True, stage_resources=PINNED))
    assert plan.host_inputs == "stream_rlhf.driver.resume:resume_inputs"
    fresh = plan.flow.stages["actor_train"]
    assert resume_inputs("actor_train", fresh) == []  # a fresh run reads nothing of the run folder

    def resumed(stage: str) -> StageSpec:
        spec = plan.flow.stages[stage]
        job = spec.kwargs["job"]
        point = ResumePoint(4, job.run_dir / "checkpoints" / "iter-000004")
        return replace(spec, kwargs={**spec.kwargs, "job": replace(job, resume=point)})

    assert resume_inputs("actor_train", resumed("actor_train")) == [
        "checkpoints/iter-000004/actor", "metrics.jsonl", "samples.jsonl"]
    assert resume_inputs("critic_train", resumed("critic_train")) == [
        "checkpoints/iter-000004/critic", "critic_metrics.jsonl"]
    assert resume_inputs("rollout", resumed("rollout")) == ["checkpoints/generated"]
    assert resume_inputs("prompts", resumed("prompts")) == ["checkpoints/prompt_cursor.jsonl"]
    assert resume_inputs("ref_forward", resumed("ref_forward")) == []
    # Medusa's heads: the newest part at or before the checkpoint (not every checkpoint has one)
    medusa = resumed("actor_train")  # medusa_train's spec carries the same job
    assert resume_inputs("medusa_train", medusa) == []
    checkpoints = tmp_path / "across" / "checkpoints"
    for version in (2, 4, 6):
        (checkpoints / f"iter-{version:06d}" / "medusa").mkdir(parents=True)
        (checkpoints / f"iter-{version:06d}" / "medusa" / "MANIFEST.json").write_text("{}")
    assert resume_inputs("medusa_train", medusa) == ["checkpoints/iter-000004/medusa"]
    moved = on_host(resumed("actor_train"), str(tmp_path / "host" / "across"), None).kwargs["job"]
    assert moved.resume == ResumePoint(4, tmp_path / "host" / "across" / "checkpoints" / "iter-000004")


def test_critic_versions_reach_critic_forward_on_another_host_by_its_own_group(tmp_path, monkeypatch):
    """With an address book (ranks on several hosts) critic_train's leader sends each critic version
    to critic_forward's group; the forward's leader writes it into its own host's store, asks only
    for versions it lacks, and a drain while it waits aborts the step."""
    import threading
    from types import SimpleNamespace

    from safetensors.torch import load_file

    from stream_rlhf.distributed import RankGroup
    from stream_rlhf.stage import StepAborted
    from stream_rlhf.stages.critic_weights import CriticRelay, open_critic_sender
    from stream_rlhf.stages.job_context import JobContext
    from stream_rlhf.weights import address_book
    from stream_rlhf.weights.shm_store import WeightStore

    job = JobContext(build(RLJobConfig, tiny_job(tmp_path, "critic", weights={"timeout_s": 30.0})), "unused",
                     str(tmp_path / "forward-host-weights"))
    assert open_critic_sender(job) is None and CriticRelay.join(job, RankGroup.single()) is None  # one host
    _store, book = address_book.host_book("127.0.0.1")
    monkeypatch.setenv(address_book.BOOK_ENV, book)
    sender = open_critic_sender(job)
    relay = CriticRelay.join(job, RankGroup.single())
    store = WeightStore(job.weights_root, "critic")
    ctx = SimpleNamespace(stopping=threading.Event(), group=RankGroup.single())
    try:
        weights = {"v_head.weight": torch.full((2, 3), 7.0), "model.norm.weight": torch.ones(3)}
        sender.publish(weights.items(), 2)
        relay.fetch(1, store, ctx)
        assert relay.received == 2 and store.latest_version() == 2
        held = load_file(str(store.path(2)))
        assert torch.equal(held["v_head.weight"], weights["v_head.weight"])
        relay.fetch(2, store, ctx)  # held already: nothing asked
        assert relay.receiver._requests == 1
        ctx.stopping.set()
        with pytest.raises(StepAborted, match="critic version 3"):
            relay.fetch(3, store, ctx)
    finally:
        relay.close()
        sender.close()


def test_the_ray_launcher_refuses_to_split_stages_that_meet_through_one_hosts_store(tmp_path):
    pytest.importorskip("ray", reason="the ray extra is not installed")
    from stream_rlhf.launch.ray_job import RayJob
    from stream_rlhf.launch.spec import StageFailed

    shm = {"rollout": {"n": 1}, "actor_train": {"n": 1}}  # pinned together: the store stays
    job = RayJob(preview_plan(across(tmp_path, node_hosts=True, stage_resources=shm)))
    job.placed = {"broker": {"host_id": "a"}, "rollout-0": {"host_id": "a"}, "actor_train-0": {"host_id": "a"},
                  "critic_forward-0": {"host_id": "b"}, "critic_train-0": {"host_id": "a"}}
    job._check_same_host()  # the critic crosses hosts by its broadcast group
    job.placed["actor_train-0.rank1"] = {"host_id": "b"}
    with pytest.raises(StageFailed, match=r"rollout \(on a\) and actor_train \(on a, b\) must share a host: "
                                          r"weights.transport=shm is one host's"):
        job._check_same_host()
    assert job.failed == ["rollout", "actor_train"]
