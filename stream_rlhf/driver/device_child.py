"""The driver's own work on a GPU (the warm start's SFT, the evaluations before and after RL) in a
short-lived process of its own, so that the driver never holds a CUDA context.

    folder = on_job_device(cfg, "warm start", warm_start, cfg)   # a child process when the job is on cuda

A process that touches CUDA keeps a context on the device (~0.5 GB, issue 32) until it exits, and
the driver lives as long as the job: its context would sit beside the stages' for the whole run.
On the CPU the call runs here. The child is spawned (a fresh interpreter: CUDA does not survive a
fork), logs as the driver does under the name given, and its exception is raised here.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from typing import TypeVar

from stream_rlhf.launch.spec import setup_logging
from stream_rlhf.rl.config import RLJobConfig

T = TypeVar("T")


def on_job_device(cfg: RLJobConfig, name: str, fn: Callable[..., T], *args: object) -> T:
    """`fn(*args)`: in a child process named `name` when `cfg`'s models live on CUDA, else here."""
    if cfg.placement.resolved_device() != "cuda":
        return fn(*args)
    with ProcessPoolExecutor(max_workers=1, mp_context=mp.get_context("spawn"), initializer=_child_setup,
                             initargs=(name, logging.getLogger().level)) as child:
        return child.submit(fn, *args).result()


def _child_setup(name: str, level: int) -> None:
    mp.current_process().name = name
    setup_logging(level)
