"""`stream-rlhf` end to end in a subprocess: the demo job, config errors, keys."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from stream_rlhf.broker.payload import shm
from tests.waiting import wait_for

pytestmark = pytest.mark.slow
DEMO = str(Path(__file__).resolve().parent.parent / "configs" / "broker_demo.yaml")


def stream_rlhf(*args: str, cwd: Path | None = None, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "stream_rlhf.cli", *args], capture_output=True, text=True, timeout=timeout, cwd=cwd
    )


def live_processes_in_group(pgid: int) -> list[str]:
    """Processes of group `pgid` that are still running (zombies awaiting reaping excluded)."""
    ps = subprocess.run(["ps", "-o", "stat=,args=", "-g", str(pgid)], capture_output=True, text=True).stdout
    return [line for line in ps.splitlines() if line.strip() and not line.strip().startswith("Z")]


def test_demo_job_runs_end_to_end(tmp_path):
    run_dir = tmp_path / "run"
    result = stream_rlhf(
        "run", DEMO,
        "--set", f"stages.trainer.kwargs.run_dir={run_dir}",
        "--set", f"broker.journal={tmp_path / 'journal'}",
        "--set", "broker.shm_prefix=clidemo",
        "--set", "stages.rollout.kwargs.step_ms=10",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["experiences"] == summary["expected"] == 24
    assert summary["duplicates"] == 0 and summary["max_staleness"] <= 1
    assert "published" in result.stderr  # progress lines
    assert shm.list_segments("clidemo") == []
    assert not (tmp_path / "journal").exists()  # clean shutdown leaves no journal to replay


def test_config_error_names_the_key_and_starts_nothing():
    result = stream_rlhf("run", DEMO, "--set", "broker.queue_capacity=0")
    assert result.returncode == 2
    assert "broker.queue_capacity=0: must be >= 1" in result.stderr
    assert "listening" not in result.stderr


def test_a_missing_key_folder_is_one_line_naming_the_file(tmp_path):
    result = stream_rlhf("stats", "tcp://127.0.0.1:1", "--keys", str(tmp_path / "nowhere"))
    assert result.returncode == 2
    assert f"config error: client secret key: {tmp_path / 'nowhere' / 'client.key_secret'} not found" in result.stderr
    assert "Traceback" not in result.stderr


def test_keys_command_writes_a_usable_key_folder(tmp_path):
    result = stream_rlhf("keys", str(tmp_path / "k"))
    assert result.returncode == 0, result.stderr
    names = {p.name for p in (tmp_path / "k").rglob("*")}
    assert {"broker.key", "broker.key_secret", "client.key", "client.key_secret", "authorized_clients"} <= names


def start_long_demo(tmp_path: Path, prefix: str) -> subprocess.Popen:
    """The demo job with a practically endless prompt stream, in its own session."""
    command = [
        sys.executable, "-m", "stream_rlhf.cli", "run", DEMO,
        "--set", "stages.prompts.kwargs.iterations=100000", "--set", "stages.trainer.kwargs.iterations=100000",
        "--set", f"stages.trainer.kwargs.run_dir={tmp_path}", "--set", f"broker.shm_prefix={prefix}",
        "--set", f"broker.journal={tmp_path / 'journal'}",
    ]
    log = open(tmp_path / "log", "w+")
    job = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def trained_twice() -> bool:
        text = (tmp_path / "log").read_text()
        if "trained: weights v2" in text:
            return True
        assert job.poll() is None, text[-3000:]
        return False

    wait_for(trained_twice, 120, "'trained: weights v2' in the demo's log",
             detail=lambda: (tmp_path / "log").read_text()[-3000:])
    return job


def wait_until_gone(pgid: int, timeout_s: float) -> list[str]:
    deadline = time.monotonic() + timeout_s
    while live_processes_in_group(pgid) and time.monotonic() < deadline:
        time.sleep(0.2)
    return live_processes_in_group(pgid)


def test_ctrl_c_drains_and_leaves_no_process_or_shared_memory(tmp_path):
    job = start_long_demo(tmp_path, "ctrlc")
    os.killpg(job.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole group
    assert job.wait(timeout=60) == 130
    assert wait_until_gone(job.pid, 30) == []  # no orphan stage or broker
    assert shm.list_segments("ctrlc") == []
    log = (tmp_path / "log").read_text()
    assert "draining every stage" in log
    assert "ignored shutdown" not in log and "ignored SIGTERM" not in log  # every stage drained: none was killed


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_launcher_killed_alone_takes_its_children_with_it(tmp_path, sig):
    prefix = f"kill{int(sig)}"
    job = start_long_demo(tmp_path, prefix)
    os.kill(job.pid, sig)  # the launcher only, as `kill` or a scheduler would
    job.wait(timeout=30)
    assert wait_until_gone(job.pid, 30) == []  # SIGTERM: drained; SIGKILL: children get SIGTERM
    assert shm.list_segments(prefix) == []


def test_broker_and_stages_started_separately_as_on_a_cluster(tmp_path, free_port):
    address = f"tcp://127.0.0.1:{free_port}"
    overrides = [
        "--set", f"broker.address={address}", "--set", "broker.shm_prefix=separate",
        "--set", f"broker.journal={tmp_path / 'journal'}", "--set", f"stages.trainer.kwargs.run_dir={tmp_path}",
    ]
    module = [sys.executable, "-m", "stream_rlhf.cli"]
    logs = {name: open(tmp_path / f"{name}.log", "w+") for name in ("broker", "stages")}  # files: never a full pipe
    broker = subprocess.Popen([*module, "broker", DEMO, *overrides],
                              stdout=subprocess.PIPE, stderr=logs["broker"], text=True)
    instances = [("prompts", 0), ("rollout", 0), ("rollout", 1), ("ref_forward", 0), ("reward_forward", 0),
                 ("trainer", 0)]
    stages = [
        subprocess.Popen([*module, "stage", DEMO, name, "--broker", address,
                          "--index", str(index), *overrides], stderr=logs["stages"])
        for name, index in instances
    ]
    try:
        for stage in stages:
            assert stage.wait(timeout=120) == 0, (tmp_path / "stages.log").read_text()[-3000:]
        out, _ = broker.communicate(timeout=60)
    finally:
        for process in [broker, *stages]:
            process.kill()
    assert broker.returncode == 0, (tmp_path / "broker.log").read_text()[-3000:]
    assert json.loads(out)["joins_emitted"] == 24
    assert json.loads((tmp_path / "summary.json").read_text())["experiences"] == 24
    assert shm.list_segments("separate") == []
