"""The warm start trains where the job's models live (`placement.device`): on a GPU job's device,
so that a model of hundreds of millions of parameters is not trained on the host's cores, and its
cache entry (policy and Medusa heads) is saved on the host whatever the device was."""

from __future__ import annotations

import logging

import pytest
import torch

from stream_rlhf.config import load_config
from stream_rlhf.driver.warm_start import warm_start
from stream_rlhf.models.checkpoint import load_policy
from stream_rlhf.models.medusa import load_heads
from stream_rlhf.rl.config import RLJobConfig
from tests.bench_run import REPO


def short_warm_start(tmp_path, device: str, caplog) -> tuple[torch.nn.Module, torch.nn.Module]:
    cfg = load_config(RLJobConfig, REPO / "configs/text_ppo.yaml",
                      [f"placement.device={device}", f"model.warm_start.cache_dir={tmp_path}",
                       "model.warm_start.steps=3", "model.warm_start.batch_size=4", "rollout.medusa.enabled=true",
                       "rollout.medusa.warm_start_steps=2"])
    with caplog.at_level(logging.INFO, logger="stream_rlhf.driver.warm_start"):
        folder = warm_start(cfg)
    assert f"on a new tiny model ({device})" in caplog.text
    assert "Medusa heads step 2/2" in caplog.text
    return load_policy(folder), load_heads(folder)


def test_a_cpu_job_warm_starts_on_the_cpu(tmp_path, caplog):
    policy, heads = short_warm_start(tmp_path, "cpu", caplog)
    assert {p.device.type for p in [*policy.parameters(), *heads.parameters()]} == {"cpu"}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="trains the warm start on a CUDA device")
def test_a_cuda_job_warm_starts_on_the_gpu_and_saves_a_checkpoint_the_host_loads(tmp_path, caplog):
    policy, heads = short_warm_start(tmp_path, "cuda", caplog)
    assert {p.device.type for p in [*policy.parameters(), *heads.parameters()]} == {"cpu"}
    assert all(torch.isfinite(p).all() for p in policy.parameters())
