"""The calculator task (`task.name: tool_sums`): sums of 3 or 4 operands up to `task.max_operand`
(999 in configs/text_tool_grpo.yaml), which the tiny model cannot add reliably in its head, and
the calculator tool of `envs/calculator.py` it may call.

    problems("train", 100, seed=0, max_operand=999) -> [Problem("123+456+789=", "1368"), ...]
    demonstration(problem, use_tool=True)  -> policy "calc:123+456+789", observation "=1368", policy "1368"
    demonstration(problem, use_tool=False) -> policy "1368"

The reference is the sum alone; `data.arithmetic.final_reward` (which the calculator applies to
the final answer) and `data.arithmetic.reward` (the same job without the tool) score it. The warm
start shows the tool on `task.tool_fraction` of its demonstrations (chosen with a seeded draw) and
a direct answer on the rest, so RL starts from a policy that does both and can learn which pays.
Operand tuples are split into train and eval by a fixed hash of the prompt.
"""

from __future__ import annotations

import random
import zlib

from stream_rlhf.data.arithmetic import EVAL_EVERY, Problem, Split
from stream_rlhf.data.demonstration import Segment, observation, policy

CALL_PREFIX = "calc:"
"""What starts a calculator call: envs/calculator.py's CALL_PREFIX (data/ does not import envs/;
a test keeps the two equal)."""
TERMS = (3, 4)
"""Operands per prompt: each prompt draws one of these."""


def problems(split: Split, count: int, seed: int, max_operand: int = 999) -> list[Problem]:
    """`count` problems "a+b+c=" or "a+b+c+d=" with operands in [0, max_operand] from `split`,
    drawn with `seed`; the answer is the sum."""
    rng = random.Random(f"tool_sums/{split}/{seed}")
    out = []
    while len(out) < count:
        operands = [rng.randint(0, max_operand) for _ in range(rng.choice(TERMS))]
        prompt = "+".join(map(str, operands)) + "="
        if _split_of(prompt) == split:
            out.append(Problem(prompt, str(sum(operands))))
    return out


def _split_of(prompt: str) -> Split:
    return "eval" if zlib.crc32(prompt.encode()) % EVAL_EVERY == 0 else "train"


def demonstration(problem: Problem, use_tool: bool) -> tuple[Segment, ...]:
    """The turns after `problem.prompt`: a calculator call, its result and the answer, or the answer."""
    if not use_tool:
        return (policy(problem.answer),)
    expression = problem.prompt.removesuffix("=")
    return policy(CALL_PREFIX + expression), observation(f"={problem.answer}"), policy(problem.answer)


def demonstrations(batch: list[Problem], tool_fraction: float, seed: int) -> list[tuple[Segment, ...]]:
    """One demonstration per problem, the tool used on about `tool_fraction` of them (a seeded draw
    per problem, the same for the same batch and seed)."""
    rng = random.Random(f"tool_sums/demonstrations/{seed}")
    return [demonstration(problem, rng.random() < tool_fraction) for problem in batch]
