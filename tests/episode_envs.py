"""Environments the episode tests run jobs with (named by dotted path in their configs)."""

from __future__ import annotations

from collections.abc import Sequence

from stream_rlhf.envs.calculator import Calculator
from stream_rlhf.envs.environment import Turn


class FlakyCalculator(Calculator):
    """The calculator, except that its step raises for every sample whose reference ends in 3:
    those episodes fail (reason "raised"), the same ones in every run."""

    async def step(self, text: str, token_ids: Sequence[int]) -> Turn:
        if self.start is not None and self.start.reference.endswith("3"):
            raise RuntimeError(f"flaky tool: reference {self.start.reference}")
        return await super().step(text, token_ids)
