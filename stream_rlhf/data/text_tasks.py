"""The synthetic text tasks whose prompts are made in memory, by `task.name`: one call for every
place that needs them (the prompt source, the warm start, evaluation, the prompt-length checks).

    problems(cfg.task, "eval", 256, seed=0)   -> [Problem(prompt="37+5=", answer="42"), ...]
"""

from __future__ import annotations

from stream_rlhf.data import arithmetic, tool_sums
from stream_rlhf.data.arithmetic import Problem, Split
from stream_rlhf.data.task_config import TaskConfig

TEXT_TASKS = ("arithmetic", "tool_sums")
"""The tasks `problems` makes; the others (shapes, shapes_dialogue) are written as files."""


def problems(task: TaskConfig, split: Split, count: int, seed: int) -> list[Problem]:
    """`count` problems of `task` from `split`, drawn with `seed`."""
    if task.name == "arithmetic":
        return arithmetic.problems(split, count, seed, task.max_operand, task.terms)
    if task.name == "tool_sums":
        return tool_sums.problems(split, count, seed, task.max_operand)
    raise ValueError(f"task.name={task.name}: not a text task made in memory ({', '.join(TEXT_TASKS)})")
