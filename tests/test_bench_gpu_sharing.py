"""bench/gpu_sharing.py's parts that run without a GPU: the columns' configs, nvidia-smi's reading
and its peak over a run, the MPS server's start and stop around a run (driven through a stand-in
for nvidia-cuda-mps-control, which this machine lacks: the real one runs in scripts/gpu_checks.sh
sharing), the figures and table, and the clear refusal on a machine without nvidia-smi."""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from stream_rlhf.config import load_config
from stream_rlhf.rl.config import RLJobConfig
from tests.bench_run import REPO
from tests.waiting import wait_for

sys.path.insert(0, str(REPO / "bench"))
import gpu_sharing  # noqa: E402 - bench/ scripts import each other by file name


def test_the_columns_share_the_job_but_the_device_groups():
    separate, groups, mps = (gpu_sharing.column_overrides(c, 6, "p") for c in gpu_sharing.COLUMNS)

    def job(sets: list[str]) -> list[str]:
        return [s for s in sets if not s.startswith(("name=", "broker.shm_prefix="))]

    assert job(separate) == job(mps) and "placement.device=cuda" in separate and "iterations=6" in separate
    cfg = load_config(RLJobConfig, REPO / gpu_sharing.CONFIG, groups)
    assert cfg.placement.device == "cuda"
    assert sorted(cfg.placement.device_groups) == ["forwards", "trainers"]
    assert "actor_train" in cfg.placement.device_groups["trainers"]
    assert not any(".offload=" in s for s in groups)  # sharing the device, nothing moved off it
    with pytest.raises(ValueError, match="one of separate, groups, mps"):
        gpu_sharing.column_overrides("colocated", 6, "p")


def test_nvidia_smi_reading_and_its_peak_over_a_run():
    assert gpu_sharing.memory_used_mb("1234\n") == 1234.0
    with pytest.raises(RuntimeError, match="nvidia-smi memory.used: cannot read '\\[N/A\\]"):
        gpu_sharing.memory_used_mb("[N/A]\n")
    readings = itertools.chain([500.0, 900.0, 2500.0, 1800.0], itertools.repeat(700.0))
    peak = gpu_sharing.DeviceMemoryPeak(read=lambda: next(readings))
    stop = peak.watch(pid=0)
    wait_for(lambda: peak.peak_mb == 2500.0, 30, "the sampler to see the peak")
    stop()
    assert peak.before_mb == 500.0 and peak.job_mb == 2000.0


def stand_in_control(folder: Path, start_code: int, message: str = "") -> Path:
    """An executable that answers as nvidia-cuda-mps-control: `-d` exits with `start_code` (and
    `message`), anything read on stdin (the quit) is appended to folder/said."""
    script = folder / "mps-control"
    script.write_text(f"#!/bin/sh\nif [ \"$1\" = -d ]; then echo '{message}' >&2; "
                      f"echo \"$CUDA_MPS_PIPE_DIRECTORY\" > {folder}/pipe; exit {start_code}; fi\n"
                      f"cat >> {folder}/said\n")
    script.chmod(0o755)
    return script


def test_the_mps_server_is_started_for_the_block_and_quit_after(tmp_path):
    control = stand_in_control(tmp_path, 0)
    with gpu_sharing.mps_server(str(control)) as env:
        pipe = Path(env["CUDA_MPS_PIPE_DIRECTORY"])
        assert pipe.is_dir() and Path(env["CUDA_MPS_LOG_DIRECTORY"]).is_dir()
        assert (tmp_path / "pipe").read_text().strip() == str(pipe)  # the server got the same folders
        assert not (tmp_path / "said").exists()
    assert (tmp_path / "said").read_text() == "quit\n"


def test_an_mps_server_that_cannot_start_says_why(tmp_path):
    control = stand_in_control(tmp_path, 1, "An instance of this daemon is already running")
    with pytest.raises(gpu_sharing.MpsUnavailable, match="-d exited with 1: An instance of this daemon"):
        with gpu_sharing.mps_server(str(control)):
            pass
    with pytest.raises(gpu_sharing.MpsUnavailable, match="No such file"):
        with gpu_sharing.mps_server(str(tmp_path / "nowhere")):
            pass
    if shutil.which("nvidia-cuda-mps-control") is None:
        with pytest.raises(gpu_sharing.MpsUnavailable, match="nvidia-cuda-mps-control is not on PATH"):
            with gpu_sharing.mps_server():
                pass


def test_figures_and_table_name_the_fastest_and_the_leanest_column():
    results = {"separate": {"iteration_s": 1.0, "device_mb": 5000.0, "processes": 9, "tokens_per_s": 100.0},
               "groups": {"iteration_s": 1.2, "device_mb": 2500.0, "processes": 6, "tokens_per_s": 90.0}}
    unavailable = {"mps": "nvidia-cuda-mps-control is not on PATH"}
    line = gpu_sharing.figures(results, unavailable)
    assert line["fastest"] == "separate" and line["least_device_memory"] == "groups"
    assert line["device_mb_groups_over_separate"] == 0.5 and line["iter_s_groups_over_separate"] == 1.2
    assert line["unavailable"] == unavailable
    table = gpu_sharing.format_table(results, unavailable, 8)
    assert "fastest: separate; least device memory: groups" in table
    assert "mps: not run: nvidia-cuda-mps-control is not on PATH" in table


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None,
                    reason="this machine has nvidia-smi: the benchmark would run (scripts/gpu_checks.sh sharing)")
def test_without_nvidia_smi_it_refuses_and_says_where_it_runs():
    result = subprocess.run([sys.executable, "bench/gpu_sharing.py", "--iterations", "4"], cwd=REPO,
                            capture_output=True, text=True, timeout=120, env={**os.environ})
    assert result.returncode == 1
    assert "nvidia-smi not found: this benchmark runs on a CUDA machine" in result.stderr
