"""The embedded default task: small arithmetic with a verifiable answer, and its multi-step form.

    problems("train", 1000, seed=0)            -> [Problem(prompt="37+5=", answer="42"), ...]
    reward("37+5=", "42", "42")                -> 1.0
    problems("train", 1000, seed=0, terms=3)   -> [Problem(prompt="12+7+30=", answer="19,49"), ...]
    final_reward("12+7+30=", "18,49", "19,49") -> 1.0    (the outcome: the last number)
    step_reward("12+7+30=", ["18", "49"], "19,49") -> [0.0, 1.0]   (a rule PRM: each partial sum)

Operand tuples are split into train and eval by a fixed hash, so evaluation never sees one used
for SFT or RL. With `terms` > 2 the answer is every partial sum from the second operand on,
comma-separated: each is a step a rule can check. `reward` is the rule-based reward the default
configs name by dotted path (`stream_rlhf.data.arithmetic:reward`); `final_reward` and
`step_reward` are the multi-step task's outcome and process rewards (`reward.process.function`).
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


def problems(split: Split, count: int, seed: int, max_operand: int = 99, terms: int = 2) -> list[Problem]:
    """`count` problems "a+b+...=" of `terms` operands in [0, max_operand] from `split`, drawn with
    `seed`; the answer is the partial sums after the second operand on, joined by ","."""
    rng = random.Random(f"{split}/{seed}")
    out = []
    while len(out) < count:
        operands = [rng.randint(0, max_operand) for _ in range(terms)]
        if _split_of(operands, max_operand) == split:
            partial = [sum(operands[:k + 1]) for k in range(1, terms)]
            out.append(Problem("+".join(map(str, operands)) + "=", ",".join(map(str, partial))))
    return out


def _split_of(operands: list[int], max_operand: int) -> Split:
    index = 0
    for operand in operands:  # the operands as digits of a base-(max_operand + 1) number
        index = index * (max_operand + 1) + operand
    return "eval" if index * 2654435761 % 2**32 % EVAL_EVERY == 0 else "train"


def reward(prompt: str, response: str, reference: str) -> float:
    """1.0 for the exact answer, 0.1 for a number of the right length, else 0."""
    text = response.strip()
    if text == reference:
        return 1.0
    return 0.1 if text.isdigit() and len(text) == len(reference) else 0.0


def final_reward(prompt: str, response: str, reference: str) -> float:
    """The multi-step task's outcome: `reward` of the last comma-separated number alone."""
    return reward(prompt, response.strip().split(",")[-1], reference.split(",")[-1])


def step_reward(prompt: str, steps: list[str], reference: str) -> list[float]:
    """A rule PRM for the multi-step task: 1.0 for each step that is the right partial sum, 0.0
    for a wrong one and for steps beyond the reference's."""
    expected = reference.split(",")
    return [float(k < len(expected) and step.strip() == expected[k]) for k, step in enumerate(steps)]
