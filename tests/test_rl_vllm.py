"""`stream-rlhf run` with `rollout.backend: vllm` and each CPU weight-sync transport: real broker,
real stage processes, a real vLLM engine process per rollout instance."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from stream_rlhf.telemetry.metrics import read_metrics
from tests.rl_tiny import tiny_job, write_job
from tests.vllm_env import REPO, vllm_python

pytestmark = pytest.mark.slow


def run(tmp_path: Path, config: Path, *sets: str, timeout_s: float = 540) -> dict:
    log = tmp_path / f"{config.stem}.log"
    with log.open("w") as out:
        process = subprocess.run([sys.executable, "-m", "stream_rlhf.cli", "run", str(config),
                                  *(x for s in sets for x in ("--set", s))],
                                 check=False, stdout=out, stderr=subprocess.STDOUT, timeout=timeout_s, cwd=REPO)
    assert process.returncode == 0, log.read_text()[-4000:]
    return json.loads((Path(tmp_path) / config.stem / "summary.json").read_text())


def assert_every_sample_trained(summary: dict, iterations: int, samples: int) -> None:
    assert summary["iterations"] == iterations
    assert summary["samples_generated"] == summary["samples_trained"] == iterations * samples
    # rollout took every version: with overlap_depth 1 a rollout stuck on old weights would have
    # its samples dropped as too stale
    assert summary["samples_dropped"] == 0 and summary["max_staleness"] <= 1


@pytest.mark.vllm
@pytest.mark.timeout(600)
def test_tiny_ppo_on_two_vllm_engines_with_broadcast_groups_and_in_flight_updates(tmp_path):
    config = write_job(tmp_path / "vllm_bcast.yaml", tiny_job(
        tmp_path, "vllm_bcast", iterations=3, overlap_depth=1, broker={"shm_prefix": "t_vllm_bcast"},
        **{"rollout.backend": "vllm", "rollout.instances": 2,
           "rollout.vllm": {"python": vllm_python(), "sleep": True},  # sleep: a no-op on CPU, said once
           "weights": {"transport": "broadcast", "update": "in_flight", "timeout_s": 240.0}},
    ))
    summary = run(tmp_path, config)
    assert_every_sample_trained(summary, 3, 16)
    log = (tmp_path / "vllm_bcast.log").read_text()
    assert log.count("vLLM engine ready") == 2  # two instances, each with its engine and weight group
    assert "vLLM sleep mode exists only on CUDA" in log


@pytest.mark.timeout(600)
def test_tiny_ppo_on_torch_with_a_broadcast_group(tmp_path):
    config = write_job(tmp_path / "torch_bcast.yaml", tiny_job(
        tmp_path, "torch_bcast", iterations=3, overlap_depth=1, broker={"shm_prefix": "t_torch_bcast"},
        weights={"transport": "broadcast", "bucket_mb": 1},
    ))
    summary = run(tmp_path, config)
    assert_every_sample_trained(summary, 3, 16)


@pytest.mark.vllm
@pytest.mark.timeout(1200)
def test_text_ppo_on_vllm_raises_the_reward(tmp_path):
    """The default text job with one key changed: rollout through vLLM (weights through the
    shared-memory file between mini-batches); 16 of its 40 iterations (on the torch backend eval
    reward rises from 0.33 to 0.46 in those)."""
    summary = run(tmp_path, REPO / "configs" / "text_ppo.yaml", "rollout.backend=vllm",
                  f"rollout.vllm.python={vllm_python()}", f"runs_dir={tmp_path}", "broker.shm_prefix=t_ppo_vllm",
                  "iterations=16", timeout_s=1100)
    assert_every_sample_trained(summary, 16, 256)
    assert summary["eval_reward_after"] > summary["eval_reward_before"] + 0.05, summary
    records = read_metrics(tmp_path / "text_ppo" / "metrics.jsonl")
    assert records[-1]["reward"] > records[0]["reward"]


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None,
                    reason="this environment has vllm: the error for a Python without it cannot be shown here")
def test_the_vllm_backend_without_vllm_is_a_clear_error_before_anything_starts(tmp_path):
    """The main environment has no vLLM (it lives in .venv-vllm): the job must say so and how to fix it."""
    config = write_job(tmp_path / "novllm.yaml", tiny_job(tmp_path, "novllm", **{"rollout.backend": "vllm"}))
    result = subprocess.run([sys.executable, "-m", "stream_rlhf.cli", "run", str(config)], capture_output=True,
                            text=True, timeout=120, check=False, cwd=REPO)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "rollout.vllm.python=" in result.stderr and "vllm is not installed there" in result.stderr
    assert not (tmp_path / "novllm" / "summary.json").exists()
