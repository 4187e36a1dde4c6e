"""Environments the episode tests run jobs with (named by dotted path in their configs)."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time
from collections.abc import Sequence

from stream_rlhf.envs.calculator import Calculator
from stream_rlhf.envs.environment import EpisodeStart, Observation, Turn


class FlakyCalculator(Calculator):
    """The calculator, except that its step raises for every sample whose reference ends in 3:
    those episodes fail (reason "raised"), the same ones in every run. With `closes` (a file) its
    close appends the reference there, and raises for references ending in 7. With `hang_file`:
    while that file exists, the next step removes it and never returns (a thread stuck in a call:
    for env.processes, whose stuck process is killed)."""

    def __init__(self, latency_s: float = 0.0, closes: str | None = None, hang_file: str | None = None):
        super().__init__(latency_s, 0.0)
        self.closes, self.hang_file = closes, hang_file

    async def step(self, text: str, token_ids: Sequence[int]) -> Turn:
        if self.hang_file is not None:
            try:
                os.remove(self.hang_file)  # one step of all the processes' succeeds
                await asyncio.to_thread(time.sleep, 600)
            except FileNotFoundError:
                pass
        if self.start is not None and self.start.reference.endswith("3"):
            raise RuntimeError(f"flaky tool: reference {self.start.reference}")
        return await super().step(text, token_ids)

    def close(self) -> None:
        if self.closes is None or self.start is None:
            return
        with open(self.closes, "a") as file:
            file.write(self.start.reference + "\n")
        if self.start.reference.endswith("7"):
            raise OSError(f"sandbox of reference {self.start.reference} already gone")


class Jittery:
    """Answers every policy turn with "=1" after a delay of up to `max_delay_s` drawn from
    (`jitter`, the reference, the turn), rewarding a turn with a digit 1; done after `turns`
    turns. Another `jitter` makes the episodes' turns start in other orders and company."""

    def __init__(self, turns: int = 3, max_delay_s: float = 0.03, jitter: int = 0):
        self.turns, self.max_delay_s, self.jitter = turns, max_delay_s, jitter
        self.reference, self.seen = "", 0

    def reset(self, start: EpisodeStart) -> None:
        self.reference, self.seen = start.reference, 0

    async def step(self, text: str, token_ids: Sequence[int]) -> Turn:
        self.seen += 1
        await asyncio.sleep(self.max_delay_s * random.Random(f"{self.jitter}/{self.reference}/{self.seen}").random())
        return Turn(Observation("=1"), reward=float("1" in text), done=self.seen >= self.turns)


class ShowsImage:
    """A vision-language episode whose first observation shows images: `images` (paths), or the
    episode's own prompt image again when empty; by <image> markers in the middle of its text
    (`marker`) or, without markers, each image's run at the text's start. Later observations are
    text; done after `turns` policy turns, reward 0.5 per turn."""

    def __init__(self, images: list[str] | None = None, marker: bool = False, turns: int = 3):
        self.images, self.marker, self.turns = list(images or ()), marker, turns
        self.start: EpisodeStart | None = None
        self.seen = 0

    def reset(self, start: EpisodeStart) -> None:
        self.start, self.seen = start, 0

    def step(self, text: str, token_ids: Sequence[int]) -> Turn:
        if self.start is None:
            raise RuntimeError("step before reset")
        self.seen += 1
        if self.seen >= self.turns:
            return Turn(None, reward=0.5, done=True)
        if self.seen > 1:
            return Turn(Observation(" more?"), reward=0.5)
        images = tuple(self.images) or self.start.images[:1]
        words = " see " + "<image>" * len(images) + " now?" if self.marker else " see now?"
        return Turn(Observation(words, images=images), reward=0.5)


class Messages:
    """Answers each turn with the observation `text` as a chat message of `role` (`roles`: a tuple
    of messages of those roles, the k-th text `text` + k); done after `turns`."""

    def __init__(self, role: str | None = "tool", text: str = "=19", turns: int = 3,
                 roles: list[str | None] | None = None):
        self.role, self.text, self.turns, self.roles = role, text, turns, roles
        self.seen = 0

    def reset(self, start: EpisodeStart) -> None:
        self.seen = 0

    def step(self, text: str, token_ids: Sequence[int]) -> Turn:
        self.seen += 1
        if self.seen >= self.turns:
            return Turn(None, reward=0.1, done=True)
        if self.roles is None:
            return Turn(Observation(self.text, role=self.role), reward=0.1)
        return Turn(tuple(Observation(f"{self.text}{k}", role=r) for k, r in enumerate(self.roles)), reward=0.1)


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first term
        b: the second term
    """
    return a + b


async def lookup(key: str) -> dict:
    """Look a key up.

    Args:
        key: what to look up
    """
    if key == "missing":
        raise KeyError(key)
    return {"key": key, "found": True}


def undescribed(x):  # no type hints, no docstring: env.tools refuses it
    return x


def exact(answer: str, reference: str) -> float:
    """ToolCalls' reward: 1.0 when the answer is the reference."""
    return float(answer == reference)


class InProcess:
    """For `env.processes`: each step's reward is the id of the process it ran in; observation
    "=1", done after `turns`. `hang_turn` (sync: a thread that cannot be stopped) sleeps `hang_s` on
    that turn for episodes whose reference ends in `hang_digit`; `die_turn` kills the process on
    that turn for those episodes; `closes` (a file) gets "<reference> <pid>" per close."""

    def __init__(self, turns: int = 2, hang_turn: int = 0, hang_s: float = 60.0, die_turn: int = 0,
                 hang_digit: str = "0", closes: str | None = None):
        self.turns, self.hang_turn, self.hang_s, self.die_turn = turns, hang_turn, hang_s, die_turn
        self.hang_digit, self.closes = hang_digit, closes
        self.seen = 0
        self.reference = ""

    def reset(self, start: EpisodeStart) -> None:
        self.reference = start.reference

    def step(self, text: str, token_ids: Sequence[int]) -> Turn:
        self.seen += 1
        chosen = self.reference.endswith(self.hang_digit)
        if chosen and self.seen == self.hang_turn:
            time.sleep(self.hang_s)
        if chosen and self.seen == self.die_turn:
            os.kill(os.getpid(), signal.SIGKILL)
        return Turn(Observation("=1"), reward=float(os.getpid()), done=self.seen >= self.turns)

    def close(self) -> None:
        if self.closes is not None:
            with open(self.closes, "a") as file:
                file.write(f"{self.reference} {os.getpid()}\n")
