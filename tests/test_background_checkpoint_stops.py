"""A run stopped or killed while a trainer writes a checkpoint in the background: a SIGTERM waits
for the write (the newest checkpoint is complete), a kill leaves only a staging folder that no
resume picks (the run recovers from the checkpoint before). Each write is held open for a few
seconds, its files on disk and its manifest not yet, by the writer's own test hook
(`STREAM_RLHF_CHECKPOINT_WRITE_DELAY_S`, `resume/background_writer.py`)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from stream_rlhf.resume.background_writer import WRITE_DELAY_VARIABLE
from stream_rlhf.resume.store import CheckpointStore
from stream_rlhf.telemetry.metrics import read_metrics
from tests.rl_tiny import tiny_job, write_job

pytestmark = pytest.mark.slow

ITERATIONS, PER_ITERATION = 10, 2 * 8
"""Enough that a SIGTERM at HELD_VERSION stops the run before its end: training goes on during the
held write until the next save waits for it."""
PARTS = ["actor", "critic"]
"""PPO: both trainers write their parts in the background."""
HELD_VERSION = 4
"""The checkpoint whose write the tests stop or kill the run in (the one before it is 2)."""


def _start(tmp_path: Path, name: str, *extra: str) -> tuple[subprocess.Popen, Path]:
    data = tiny_job(tmp_path, name, broker={"shm_prefix": f"b_{name}"}, iterations=ITERATIONS, overlap_depth=1,
                    checkpoint={"every": 2, "keep": 3, "recoveries": 1})
    config = write_job(tmp_path / f"{name}.yaml", data)
    log = tmp_path / f"{name}.log"
    with log.open("a") as out:
        process = subprocess.Popen([sys.executable, "-m", "stream_rlhf.cli", "run", str(config), *extra],
                                   stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                   env={**os.environ, WRITE_DELAY_VARIABLE: "4"})
    return process, log


def _held_write(run_dir: Path, process: subprocess.Popen, log: Path) -> Path:
    """The staging folder of actor's part of checkpoint HELD_VERSION once its files are written
    and its manifest is not (the write is held open)."""
    deadline = time.monotonic() + 300
    folder = CheckpointStore(run_dir / "checkpoints").folder(HELD_VERSION)
    while not (held := [s for s in folder.glob(".actor.*.tmp") if (s / "state.json").is_file()]):
        assert process.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.05)
    assert not (folder / "actor" / "MANIFEST.json").exists()
    return held[0]


def _assert_every_sample_trained_once(run_dir: Path) -> dict:
    summary = json.loads((run_dir / "summary.json").read_text())
    assert [r["iteration"] for r in read_metrics(run_dir / "metrics.jsonl")] == list(range(ITERATIONS))
    assert summary["samples_trained"] == ITERATIONS * PER_ITERATION and summary["samples_dropped"] == 0
    return summary


def test_a_sigterm_during_a_background_write_waits_for_it_and_the_run_resumes_from_it(tmp_path):
    run_dir = tmp_path / "stopped"
    process, log = _start(tmp_path, "stopped")
    _held_write(run_dir, process, log)
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=180) == 130, log.read_text()[-3000:]
    store = CheckpointStore(run_dir / "checkpoints")
    assert HELD_VERSION in store.versions(PARTS)  # the drain waited for the writes under way
    point = store.latest(PARTS)
    assert point is not None and point.version >= HELD_VERSION  # it, or the stop's own save after it
    assert not list((run_dir / "checkpoints").glob("iter-*/.*.tmp"))  # no write was cut short
    process, log = _start(tmp_path, "stopped", "--resume")
    assert process.wait(timeout=300) == 0, log.read_text()[-3000:]
    summary = _assert_every_sample_trained_once(run_dir)
    assert summary["resumed_from"] == [point.version]


def test_a_trainer_killed_during_a_background_write_is_recovered_from_the_checkpoint_before(tmp_path):
    run_dir = tmp_path / "killed"
    process, log = _start(tmp_path, "killed")
    staging = _held_write(run_dir, process, log)
    writer_pid = int(staging.name.split(".")[2])  # `.actor.<pid>.tmp`: the trainer's process
    os.kill(writer_pid, signal.SIGKILL)
    assert process.wait(timeout=400) == 0, log.read_text()[-3000:]
    assert "recovering from the failure of actor_train-0" in log.read_text()
    summary = _assert_every_sample_trained_once(run_dir)
    assert summary["resumed_from"] == [HELD_VERSION - 2]  # the half-written one was never picked
    assert CheckpointStore(run_dir / "checkpoints").latest(PARTS).version == ITERATIONS
