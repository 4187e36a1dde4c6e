"""The embedded tool environment: sums of several large operands, which the tiny policy cannot
add reliably in its head, and a calculator it may call.

    prompt     123+456+789=
    policy     calc:123+456+789<eos>          a tool call: one turn
    observation =1368                         appended by this environment (loss mask 0)
    policy     1368<eos>                      the answer: reward 1.0, done

A turn that starts with `calc:` is a call; anything else is the final answer, scored with
`data.arithmetic.final_reward` against the reference's last number. `latency_s` makes every call
wait (asyncio, so other episodes go on): the tool latency the benchmark hides. `cpu_s` makes every
call compute in pure Python (in a thread, holding the GIL) for that long: a verifier's cost, which
`env.processes` moves out of the rollout process (bench/env_processes.py).
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Sequence

from stream_rlhf.data.arithmetic import final_reward
from stream_rlhf.envs.environment import EpisodeStart, Observation, Turn

CALL_PREFIX = "calc:"
_EXPRESSION = re.compile(r"\d{1,12}(?:[+\-*]\d{1,12}){0,15}")


def evaluate(expression: str) -> int | None:
    """The value of "a+b-c*d" (integers, usual precedence), or None for anything else."""
    text = expression.replace(" ", "")
    if not _EXPRESSION.fullmatch(text):
        return None
    total = 0
    for sign, term in re.findall(r"([+\-]?)([^+\-]+)", text):
        product = 1
        for factor in term.split("*"):
            product *= int(factor)
        total += -product if sign == "-" else product
    return total


def compute_for(seconds: float) -> int:
    """Pure-Python arithmetic for `seconds` of this thread's CPU time (it holds the GIL as it goes;
    a fixed amount of work, however many threads compete)."""
    end, total = time.thread_time() + seconds, 0
    while time.thread_time() < end:
        for i in range(1000):
            total = (total + i * i) % 1_000_003
    return total


class Calculator:
    """One episode of the calculator task (see the module docstring)."""

    def __init__(self, latency_s: float = 0.0, cpu_s: float = 0.0) -> None:
        self.latency_s, self.cpu_s = latency_s, cpu_s
        self.start: EpisodeStart | None = None
        self.calls = 0

    async def reset(self, start: EpisodeStart) -> None:
        self.start = start
        self.calls = 0

    async def step(self, text: str, token_ids: Sequence[int]) -> Turn:
        if self.start is None:
            raise RuntimeError("step before reset")
        stripped = text.strip()
        if not stripped.startswith(CALL_PREFIX):
            return Turn(None, final_reward(self.start.prompt, stripped, self.start.reference), done=True)
        self.calls += 1
        if self.latency_s:
            await asyncio.sleep(self.latency_s)
        if self.cpu_s:
            await asyncio.to_thread(compute_for, self.cpu_s)
        value = evaluate(stripped[len(CALL_PREFIX):])
        return Turn(Observation("=?" if value is None else f"={value}"))
