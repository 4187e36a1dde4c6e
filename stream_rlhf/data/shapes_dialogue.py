"""The two-question shapes task (`task.name: shapes_dialogue`): the first question asks for the
colour of one square; the environment (envs/shapes_dialogue.py) then asks how many squares have the
colour the policy named, so the second question depends on the first answer.

    problems("train", 100, seed=0) -> [Problem("<image>color at 2 3?", "red", squares), ...]
    follow_up("red")               -> "how many red?"
    demonstration("red", squares)  -> policy "red", observation "how many red?", policy "2"

The images and the train/eval split are the shapes task's (`data/shapes.py`); the files are written
like its own (JSONL + PNG) and the warm start demonstrates both turns, the count read from the image.
"""

from __future__ import annotations

import random

from stream_rlhf.data.demonstration import Segment, observation, policy
from stream_rlhf.data.shapes import Problem, Split, random_squares, split_of

Squares = tuple[tuple[int, int, str], ...]


def problems(split: Split, count: int, seed: int) -> list[Problem]:
    """`count` first questions ("color at R C?" of a filled cell, rows and columns from 1) on
    images of `split`, drawn with `seed`; the answer is that square's colour."""
    rng = random.Random(f"shapes_dialogue/{split}/{seed}")
    out = []
    while len(out) < count:
        squares = random_squares(rng)
        if split_of(squares) == split:
            row, column, color = rng.choice(squares)
            out.append(Problem(f"<image>color at {row + 1} {column + 1}?", color, squares))
    return out


def follow_up(color: str) -> str:
    """The second question, about the colour the policy named."""
    return f"how many {color}?"


def count_of(squares: Squares, color: str) -> int:
    return sum(c == color for _, _, c in squares)


def demonstration(color: str, squares: Squares) -> tuple[Segment, ...]:
    """Both turns after the first question, answered right."""
    return policy(color), observation(follow_up(color)), policy(str(count_of(squares, color)))
