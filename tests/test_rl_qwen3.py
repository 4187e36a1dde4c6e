"""`stream-rlhf run` on tiny Qwen3 and Qwen3-VL jobs, one process per stage: every sample generated
is trained. Qwen3 is the embedded tiny model (`model.tiny.architecture: qwen3`, warm-started);
Qwen3-VL is a folder made by `stream-rlhf init-model` and run as `model.path` (as a user without hub
access would), each image encoded once, by the vision stage, its deepstack features travelling with
the rest of its features."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.rl_tiny import VISION, tiny_job, write_job

pytestmark = pytest.mark.slow
SAMPLES = 2 * 2 * 8
"""2 iterations of 2 mini-batches of 8 prompts."""


def cli(*args: str, timeout_s: float = 420) -> None:
    result = subprocess.run([sys.executable, "-m", "stream_rlhf.cli", *args], check=False, capture_output=True,
                            text=True, timeout=timeout_s)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]


def assert_every_sample_trained(run_dir: Path) -> dict:
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["samples_generated"] == SAMPLES
    assert summary["samples_generated"] == (summary["samples_trained"] + summary["samples_dropped"]
                                            + summary["samples_in_flight_at_stop"])
    assert summary["samples_trained"] == SAMPLES and summary["samples_dropped"] == 0
    return summary


def test_tiny_qwen3_ppo_trains_every_sample(tmp_path):
    config = write_job(tmp_path / "q3.yaml", tiny_job(tmp_path, "q3", overlap_depth=1, broker={"shm_prefix": "t_q3"}))
    cli("run", str(config), "--set", "model.tiny.architecture=qwen3")
    assert_every_sample_trained(tmp_path / "q3")


def test_qwen3_vl_folder_from_init_model_runs_ppo_as_model_path(tmp_path):
    config = write_job(tmp_path / "q3vl.yaml", tiny_job(tmp_path, "q3vl", overlap_depth=1,
                                                        broker={"shm_prefix": "t_q3vl"}, **VISION))
    folder = tmp_path / "qwen3-vl"
    cli("init-model", str(config), str(folder), "--set", "model.tiny.architecture=qwen3",
        "--set", "model.tiny.vision.depth=2")  # deepstack features after vision block 0
    assert json.loads((folder / "config.json").read_text())["architectures"] == ["Qwen3VLForConditionalGeneration"]
    cli("run", str(config), "--set", f"model.path={folder}")
    summary = assert_every_sample_trained(tmp_path / "q3vl")
    assert summary["start_checkpoint"] == str(folder)
    assert summary["images_seen"] == summary["images_encoded"] == SAMPLES
    assert summary["images_encoded_by_stage"] == {"vision_prefetch": SAMPLES}
