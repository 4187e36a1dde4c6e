"""Checkpoints written in the background (`resume/background_writer.py`, `backends/host_snapshot.py`):
the writer's order and errors, snapshots that training no longer changes, and a run that trains
the same samples to the same weights and checkpoints with the writer on as with it off."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from stream_rlhf.backends.host_snapshot import HostSnapshots
from stream_rlhf.backends.optimizer_config import OptimizerConfig
from stream_rlhf.backends.torch_engine import TorchTrainEngine
from stream_rlhf.config import load_config
from stream_rlhf.distributed import RankGroup
from stream_rlhf.resume.background_writer import WRITE_DELAY_VARIABLE, BackgroundWriter, write_delay
from stream_rlhf.resume.store import CheckpointStore
from stream_rlhf.rl.config import RLJobConfig
from stream_rlhf.stages.job_context import JobContext
from stream_rlhf.stages.trainer_checkpoint import TrainerCheckpoints
from tests.bench_run import REPO
from tests.test_rl_inprocess import run_inprocess


def test_a_write_runs_behind_the_caller_a_second_waits_for_the_first_and_a_failure_is_raised():
    events: list[str] = []
    release = threading.Event()

    def first() -> None:
        events.append("first starts")
        release.wait(timeout=30)
        events.append("first ends")

    writer = BackgroundWriter(background=True, name="test writer")
    writer.submit(1, first)
    assert "first ends" not in events  # submit returned while the write is held
    threading.Timer(0.2, release.set).start()
    writer.submit(2, lambda: events.append("second"))
    writer.wait()
    assert events == ["first starts", "first ends", "second"]

    def broken() -> None:
        raise OSError("disk full")

    writer.submit(3, broken)
    with pytest.raises(RuntimeError, match="test writer: a background checkpoint write failed") as raised:
        writer.wait()
    assert isinstance(raised.value.__cause__, OSError)
    writer.wait()  # raised once, then forgotten
    inline = BackgroundWriter(background=False, name="inline")
    inline.submit(4, lambda: events.append("inline"))
    assert events[-1] == "inline"  # done when submit returns


def test_the_write_delay_for_tests_names_the_variable_when_it_is_not_a_number(monkeypatch):
    monkeypatch.setenv(WRITE_DELAY_VARIABLE, "soon")
    with pytest.raises(ValueError, match=f"{WRITE_DELAY_VARIABLE}='soon': expected seconds"):
        write_delay()


def test_a_snapshot_keeps_the_state_it_was_taken_from_while_training_goes_on():
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(1, 4)).sum().backward()
    optimizer.step()
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "tied": [model.weight, model.weight]}
    snapshots = HostSnapshots()
    snapshot = snapshots.take(state)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    moment = optimizer.state_dict()["state"][0]["exp_avg"].clone()
    model(torch.ones(1, 4)).sum().backward()
    optimizer.step()  # training goes on: parameters and moments change in place
    assert not torch.equal(model.weight, expected["weight"])
    for name, value in expected.items():
        assert torch.equal(snapshot["model"][name], value), name
    assert torch.equal(snapshot["optimizer"]["state"][0]["exp_avg"], moment)
    assert snapshot["tied"][0] is snapshot["tied"][1]  # one tensor stays one
    assert snapshot["optimizer"]["param_groups"][0]["lr"] == 0.1
    again = snapshots.take(state)  # the next snapshot fills the same host buffers with the new state
    assert again["model"]["weight"].data_ptr() == snapshot["model"]["weight"].data_ptr()
    assert torch.equal(again["model"]["weight"], model.weight)
    assert not torch.equal(again["model"]["weight"], expected["weight"])


def test_reserved_buffers_are_the_ones_the_first_snapshot_fills_and_a_changed_shape_gets_its_own():
    model = nn.Linear(4, 4)
    state = {"model": model.state_dict(keep_vars=True), "tied": [model.weight, model.weight], "step": 3}
    snapshots = HostSnapshots()
    snapshots.reserve(state)
    snapshots._join_reserve()  # the allocation thread is done: its buffers are what take fills
    reserved = [t.data_ptr() for t in snapshots._buffers]
    assert len(reserved) == 2  # weight (once: tied) and bias
    snapshot = snapshots.take(state)
    assert [snapshot["model"]["weight"].data_ptr(), snapshot["model"]["bias"].data_ptr()] == reserved
    assert snapshot["tied"][0] is snapshot["model"]["weight"] and snapshot["step"] == 3
    assert torch.equal(snapshot["model"]["weight"], model.weight) and torch.equal(snapshot["model"]["bias"], model.bias)
    wider = nn.Linear(4, 5)
    snapshots.reserve({"model": wider.state_dict()})
    bigger = snapshots.take({"model": wider.state_dict()})  # waits for the reserve, then copies into it
    assert torch.equal(bigger["model"]["weight"], wider.weight) and bigger["model"]["weight"].shape == (5, 4)


def test_a_trainer_reserves_its_snapshot_once_after_its_first_unsaved_iteration(tmp_path, monkeypatch):
    cfg = load_config(RLJobConfig, REPO / "configs/text_grpo.yaml",
                      [f"runs_dir={tmp_path}", "iterations=6", "checkpoint.every=3"])
    engine = TorchTrainEngine(nn.Linear(2, 2), RankGroup.single(), OptimizerConfig(lr=1e-2))
    reserved_after: list[int] = []
    version = 0
    monkeypatch.setattr(engine, "reserve_snapshot", lambda: reserved_after.append(version))
    checkpoints = TrainerCheckpoints(JobContext(cfg, "unused", str(tmp_path / "weights")), "actor", engine,
                                     RankGroup.single())
    for version in range(1, 5):
        checkpoints.iteration_started()
        checkpoints.iteration_done(version, {})
    checkpoints.writer.wait()
    assert reserved_after == [1]
    assert checkpoints.store.latest(["actor"]).version == 3


def test_an_engine_snapshot_shares_no_storage_with_the_live_model(tmp_path):
    model = nn.Sequential(nn.Linear(3, 3))
    engine = TorchTrainEngine(model, RankGroup.single(), OptimizerConfig(lr=1e-2))
    snapshot = engine.snapshot_state()
    live = {p.data_ptr() for p in model.parameters()}
    assert not live & {t.data_ptr() for t in snapshot["model"].values()}
    store = CheckpointStore(tmp_path)
    store.write_part(1, "actor", lambda folder: torch.save(snapshot, folder / "engine.pt"))
    assert store.latest(["actor"]).version == 1


def test_a_run_trains_the_same_samples_to_the_same_weights_and_checkpoints_with_and_without_the_background_writer(
        tmp_path):
    torch.set_num_threads(1)
    shape = {"schedule": "sync", "overlap_depth": 0, "iterations": 3, "algorithm.advantage": "grpo",
             "rollout_batch.samples_per_prompt": 2, "checkpoint": {"every": 1, "keep": 3}}
    runs = {background: run_inprocess(tmp_path, f"background-{background}", **shape,
                                      **{"checkpoint.background": background})
            for background in (True, False)}
    (on_cfg, on), (off_cfg, off) = runs[True], runs[False]
    assert [(r["reward"], r["tokens"], r["samples"]) for r in on] == [(r["reward"], r["tokens"], r["samples"])
                                                                      for r in off]
    on_dir, off_dir = Path(on_cfg.run_dir), Path(off_cfg.run_dir)
    on_weights = load_file(on_dir / "checkpoint" / "model.safetensors")
    off_weights = load_file(off_dir / "checkpoint" / "model.safetensors")
    for name, value in off_weights.items():
        assert torch.equal(on_weights[name], value), name
    for version in (1, 2, 3):  # every checkpoint complete and holding the same state
        on_point, off_point = (CheckpointStore(d / "checkpoints").folder(version) / "actor" / "engine.pt"
                               for d in (on_dir, off_dir))
        saved_on, saved_off = (torch.load(p, weights_only=True) for p in (on_point, off_point))
        for name, value in saved_off["model"].items():
            assert torch.equal(saved_on["model"][name], value), (version, name)
        for index, moments in saved_off["optimizer"]["state"].items():
            for key, value in moments.items():
                assert torch.equal(saved_on["optimizer"]["state"][index][key], value), (version, index, key)
    assert CheckpointStore(on_dir / "checkpoints").latest(["actor"]).version == 3
