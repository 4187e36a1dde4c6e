"""Weight versions published off the training thread (`stages/weight_publish.py`, `weights.publish`):
a version's write sees the weights of its version while training changes them, versions go out in
order, a failure is raised, and a whole run trains the same samples to the same weights either way
(its trace showing where each version was written and the trainers' phases)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import Tensor, nn

from stream_rlhf.backends.optimizer_config import OptimizerConfig
from stream_rlhf.backends.torch_engine import TorchTrainEngine
from stream_rlhf.distributed import RankGroup
from stream_rlhf.stages.weight_publish import VersionPublisher, publishes_in_background
from stream_rlhf.weights.sync_config import WeightSyncConfig
from tests.rl_tiny import tiny_job, write_job
from tests.test_rl_job import read_metrics


class TiedModel(nn.Module):
    """An embedding and an output layer sharing one weight, as a tied LM head does."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(5, 3)
        self.head = nn.Linear(3, 5, bias=False)
        self.head.weight = self.embed.weight
        self.norm = nn.LayerNorm(3)


def _engine() -> TorchTrainEngine:
    torch.manual_seed(0)
    return TorchTrainEngine(TiedModel(), RankGroup.single(), OptimizerConfig(lr=1e-2))


def test_a_background_version_is_written_as_it_was_while_training_changes_the_weights_and_in_order():
    engine = _engine()
    publisher = VersionPublisher(engine, background=True, name="test")
    release = threading.Event()
    written: list[tuple[int, dict[str, Tensor], str]] = []

    def write(weights: dict[str, Tensor], version: int) -> None:
        if version == 1:
            release.wait(timeout=30)
        written.append((version, {k: v.clone() for k, v in weights.items()}, threading.current_thread().name))
        assert weights["embed.weight"] is weights["head.weight"]  # tied: stored once

    before = {k: v.detach().clone() for k, v in engine.model.state_dict().items()}
    publisher.publish(1, write, leader=True)
    assert written == []  # publish returned while version 1's write is held
    with torch.no_grad():  # the next optimizer step changes the live weights meanwhile
        for parameter in engine.model.parameters():
            parameter.add_(1.0)
    after = {k: v.detach().clone() for k, v in engine.model.state_dict().items()}
    threading.Timer(0.2, release.set).start()
    publisher.publish(2, write, leader=True)  # waits for version 1 first
    publisher.wait()

    assert [version for version, _, _ in written] == [1, 2]
    for (_, weights, thread), expected in zip(written, (before, after), strict=True):
        assert thread == "test weights publisher"
        assert weights.keys() == expected.keys()
        for name, value in expected.items():
            assert torch.equal(weights[name], value), name
    snapshot = engine.snapshot_weights()
    assert not {p.data_ptr() for p in engine.model.parameters()} & {t.data_ptr() for t in snapshot.values()}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="snapshots a CUDA engine's weights into pinned memory")
def test_a_cuda_engine_publishes_pinned_host_copies_of_its_version():
    torch.manual_seed(0)
    engine = TorchTrainEngine(TiedModel(), RankGroup.single("cuda:0"), OptimizerConfig(lr=1e-2))
    publisher = VersionPublisher(engine, background=True, name="test")
    written: list[dict[str, Tensor]] = []
    before = {k: v.detach().cpu().clone() for k, v in engine.model.state_dict().items()}
    publisher.publish(1, lambda weights, version: written.append(weights), leader=True)
    with torch.no_grad():  # queued on the device right after the snapshot's copies
        for parameter in engine.model.parameters():
            parameter.add_(1.0)
    publisher.wait()
    [weights] = written
    assert all(t.device.type == "cpu" and t.is_pinned() for t in weights.values())
    for name, value in before.items():
        assert torch.equal(weights[name], value), name


def test_a_failed_background_write_is_raised_from_the_next_publish_or_wait():
    publisher = VersionPublisher(_engine(), background=True, name="actor")

    def broken(weights: dict[str, Tensor], version: int) -> None:
        raise OSError("no space left on /dev/shm")

    publisher.publish(1, broken, leader=True)
    with pytest.raises(RuntimeError, match="actor weights publisher: a background weights write failed") as raised:
        publisher.publish(2, broken, leader=True)
    assert isinstance(raised.value.__cause__, OSError)
    publisher.wait()  # raised once: version 2 was never taken


def test_a_sync_publish_writes_the_exported_weights_before_it_returns_and_only_on_the_leader():
    engine = _engine()
    publisher = VersionPublisher(engine, background=False, name="test")
    written: list[tuple[int, str]] = []
    publisher.publish(1, lambda weights, version: written.append((version, threading.current_thread().name)),
                      leader=True)
    assert written == [(1, threading.current_thread().name)]
    publisher.publish(2, lambda weights, version: written.append((version, "follower")), leader=False)
    assert written == [(1, threading.current_thread().name)]


def test_auto_publishes_in_the_background_on_a_gpu_and_in_the_iteration_on_the_cpu():
    auto = WeightSyncConfig()
    assert not publishes_in_background(auto, torch.device("cpu"))
    assert publishes_in_background(auto, torch.device("cuda", 0))
    for mode, expected in (("sync", False), ("background", True)):
        chosen = WeightSyncConfig(publish=mode)
        assert publishes_in_background(chosen, torch.device("cpu")) is expected
        assert publishes_in_background(chosen, torch.device("cuda", 0)) is expected


@pytest.mark.slow
def test_a_ppo_run_trains_the_same_samples_to_the_same_weights_with_its_versions_published_in_the_background(
        tmp_path):
    """Both trainers publish in the background and rollout gets each version by broadcast (its
    sender fed from the publisher's thread); the sync schedule makes the two runs comparable."""
    shape = {"iterations": 4, "schedule": "sync", "overlap_depth": 0}
    runs = {}
    for mode in ("sync", "background"):
        data = tiny_job(tmp_path, mode, broker={"shm_prefix": f"p_{mode}"}, weights={"transport": "broadcast",
                                                                                      "publish": mode}, **shape)
        config = write_job(tmp_path / f"{mode}.yaml", data)
        log = tmp_path / f"{mode}.log"
        with log.open("w") as out:
            code = subprocess.run([sys.executable, "-m", "stream_rlhf.cli", "run", str(config)], stdout=out,
                                  stderr=subprocess.STDOUT, timeout=300).returncode
        assert code == 0, log.read_text()[-3000:]
        runs[mode] = tmp_path / mode

    def trained(run: Path) -> list[tuple]:
        return [(r["iteration"], r["reward"], r["tokens"], r["samples"]) for r in read_metrics(run / "metrics.jsonl")]

    assert trained(runs["background"]) == trained(runs["sync"])
    expected = load_file(runs["sync"] / "checkpoint" / "model.safetensors")
    published = load_file(runs["background"] / "checkpoint" / "model.safetensors")
    for name, tensor in expected.items():
        assert (published[name] - tensor).abs().max().item() <= 1e-6, name
    critic = [r["value_loss"] for r in read_metrics(runs["sync"] / "critic_metrics.jsonl")]
    assert [r["value_loss"] for r in read_metrics(runs["background"] / "critic_metrics.jsonl")] == pytest.approx(
        critic, abs=1e-6)
    writes = _spans(runs["background"] / "trace.json", "weights write", "background")
    assert writes == {("actor_train-0", 1): 4, ("critic_train-0", 1): 4}  # every version, off the step's thread
    assert _spans(runs["sync"] / "trace.json", "weights write", "background") == {("actor_train-0", 0): 4,
                                                                                   ("critic_train-0", 0): 4}
    # the trainers' phases are in the trace: an experience per iteration, the optimizer steps
    assert _spans(runs["background"] / "trace.json", "experience") == {("actor_train-0", None): 4,
                                                                      ("critic_train-0", None): 4}
    steps = _spans(runs["background"] / "trace.json", "optimizer step")
    assert steps[("actor_train-0", None)] >= 4 and steps == _spans(runs["sync"] / "trace.json", "optimizer step")
    summary = json.loads((runs["background"] / "summary.json").read_text())
    assert summary["samples_trained"] == summary["samples_generated"]


def _spans(trace: Path, name: str, argument: str | None = None) -> dict[tuple[str, object], int]:
    """(process, the span's `argument`) -> how many spans called `name` the trace holds."""
    events = json.loads(trace.read_text())
    events = events["traceEvents"] if isinstance(events, dict) else events
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    counts: dict[tuple[str, object], int] = {}
    for event in events:
        if event.get("ph") == "X" and event["name"] == name:
            key = (names[event["pid"]], event["args"].get(argument) if argument else None)
            counts[key] = counts.get(key, 0) + 1
    return counts
