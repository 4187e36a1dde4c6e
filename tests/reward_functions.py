"""Reward functions the reward-pool tests run in worker processes (named by dotted path)."""

from __future__ import annotations

import os
import time


def length(prompt: str, response: str, reference: str, bonus: float = 0.0) -> float:
    """The response's length, plus `bonus`."""
    return float(len(response)) + bonus


def whoami(prompt: str, response: str, reference: str) -> float:
    """The id of the process that scored the sample (after a little work, so that calls overlap)."""
    time.sleep(0.05)
    return float(os.getpid())


def fussy(prompt: str, response: str, reference: str) -> float:
    """1.0, except: "hang" never returns, "bad" raises, "nan" is not a number."""
    if response == "hang":
        time.sleep(600)
    if response == "bad":
        raise ValueError(f"cannot read {response!r}")
    if response == "nan":
        return float("nan")
    return 1.0
