"""The embedded default task: small arithmetic with a verifiable answer.

    problems("train", 1000, seed=0)   -> [Problem(prompt="37+5=", answer="42"), ...]
    reward("37+5=", "42", "42")       -> 1.0

Operand pairs are split into train and eval by a fixed hash, so evaluation never sees a pair used
for SFT or RL. `reward` is the rule-based reward the default configs name by dotted path
(`stream_rlhf.data.arithmetic:reward`).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Literal

Split = Literal["train", "eval"]
EVAL_EVERY = 10
"""One operand pair in EVAL_EVERY belongs to the eval split."""


@dataclass(frozen=True)
class Problem:
    prompt: str
    answer: str


def problems(split: Split, count: int, seed: int, max_operand: int = 99) -> list[Problem]:
    """`count` problems "a+b=" with 0 <= a, b <= max_operand from `split`, drawn with `seed`."""
    rng = random.Random(f"{split}/{seed}")
    out = []
    while len(out) < count:
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        if _split_of(a, b, max_operand) == split:
            out.append(Problem(f"{a}+{b}=", str(a + b)))
    return out


def _split_of(a: int, b: int, max_operand: int) -> Split:
    return "eval" if (a * (max_operand + 1) + b) * 2654435761 % 2**32 % EVAL_EVERY == 0 else "train"


def reward(prompt: str, response: str, reference: str) -> float:
    """1.0 for the exact answer, 0.1 for a number of the right length, else 0."""
    text = response.strip()
    if text == reference:
        return 1.0
    return 0.1 if text.isdigit() and len(text) == len(reference) else 0.0
