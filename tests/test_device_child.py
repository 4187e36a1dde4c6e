"""The driver's own GPU work (warm start, evaluations) runs in a child process when the job's
models live on CUDA (`driver/device_child.py`), so that the driver holds no CUDA context; on the
CPU it runs in the driver. The child is a real spawned process; what it runs here needs no GPU."""

from __future__ import annotations

import multiprocessing as mp
import os

import pytest

from stream_rlhf.config import ConfigError, load_config
from stream_rlhf.driver.device_child import on_job_device
from stream_rlhf.rl.config import RLJobConfig
from tests.bench_run import REPO


def where_am_i(tag: str) -> tuple[int, str, str]:
    return os.getpid(), mp.current_process().name, tag


def job_name(cfg: RLJobConfig) -> tuple[int, str]:
    return os.getpid(), cfg.name


def refuse(key: str) -> None:
    raise ConfigError(f"{key}: refused in the child")


def job(device: str) -> RLJobConfig:
    return load_config(RLJobConfig, REPO / "configs/text_grpo.yaml", [f"placement.device={device}"])


def test_a_cpu_job_runs_it_in_the_driver():
    assert on_job_device(job("cpu"), "eval", where_am_i, "x") == (os.getpid(), mp.current_process().name, "x")


@pytest.mark.slow  # spawns an interpreter that imports the project (~3-5 s)
def test_a_cuda_job_runs_it_in_a_named_child_and_raises_its_error_here():
    pid, name, tag = on_job_device(job("cuda"), "warm start", where_am_i, "y")
    assert pid != os.getpid() and name == "warm start" and tag == "y"
    cfg = job("cuda")
    child, name = on_job_device(cfg, "eval", job_name, cfg)  # the job's config travels as warm_start's does
    assert child != os.getpid() and name == cfg.name
    with pytest.raises(ConfigError, match="data.train: refused in the child"):
        on_job_device(job("cuda"), "eval", refuse, "data.train")
