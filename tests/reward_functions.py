"""Reward functions the reward-pool tests run in worker processes (named by dotted path)."""

from __future__ import annotations

import os
import time

from stream_rlhf.data.arithmetic import step_reward


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


def step_lengths(prompt: str, steps: list[str], reference: str) -> list[float]:
    """Each step's length, except: a step "hang" never returns, a step "odd" returns a string."""
    if "hang" in steps:
        time.sleep(600)
    if "odd" in steps:
        return "odd"  # type: ignore[return-value]
    return [float(len(step)) for step in steps]


def step_reward_hanging_once(prompt: str, steps: list[str], reference: str) -> list[float]:
    """The multi-step task's step rule, except that the run's first call (the file named by
    $HANG_ONCE_MARKER absent: this call creates it) never returns."""
    marker = os.environ.get("HANG_ONCE_MARKER")
    if marker is not None:
        try:
            os.close(os.open(marker, os.O_CREAT | os.O_EXCL))
            time.sleep(600)
        except FileExistsError:
            pass
    return step_reward(prompt, steps, reference)
