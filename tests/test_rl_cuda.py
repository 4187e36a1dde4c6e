"""`stream-rlhf run` with every torch stage on a CUDA device: the tiny PPO job of test_rl_job.py,
its models, forwards, training, sampler and weight sync on `cuda:0` (also in bf16 mixed precision).

    .venv/bin/python -m pytest -m gpu tests/test_rl_cuda.py -q
"""

from __future__ import annotations

import json
import re

import pytest
import torch

from stream_rlhf.telemetry.metrics import read_metrics
from tests.test_rl_job import leftover_shm, start_run

pytestmark = [
    pytest.mark.slow,
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="places every torch stage on a CUDA device"),
]


@pytest.mark.parametrize("schedule,overlap_depth,precision", [("stream", 1, "fp32"), ("sync", 0, "fp32"),
                                                               ("stream", 1, "bf16")])
def test_tiny_ppo_job_runs_every_stage_on_cuda(tmp_path, schedule, overlap_depth, precision):
    schedule_name = f"{schedule}_{precision}"
    process, log = start_run(tmp_path, f"cuda_{schedule_name}", "placement.device=cuda", f"schedule={schedule}",
                             f"overlap_depth={overlap_depth}", "iterations=3", f"precision={precision}")
    assert process.wait(timeout=300) == 0, log.read_text()[-3000:]
    text = log.read_text()
    placed = dict(re.findall(r"(\w+)-0: rank 0 of 1 on (\S+)", text))
    for stage in ("rollout", "actor_train", "critic_train", "critic_forward", "ref_forward"):
        assert placed.get(stage) == "cuda:0", (stage, placed)
    run_dir = tmp_path / f"cuda_{schedule_name}"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["samples_generated"] == 3 * 2 * 8
    assert summary["samples_generated"] == summary["samples_trained"] + summary["samples_in_flight_at_stop"]
    assert summary["samples_dropped"] == 0
    records = read_metrics(run_dir / "metrics.jsonl")
    assert len(records) == 3 and all(r["staleness_max"] <= overlap_depth for r in records)
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in records)
    assert not leftover_shm(f"t_cuda_{schedule_name}")
