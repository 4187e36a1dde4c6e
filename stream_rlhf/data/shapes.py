"""The embedded multimodal task: questions about coloured squares in a small image, with a
verifiable answer.

    write_split(folder, "train", 4096, seed=0)  -> folder/train.jsonl, PNGs in folder/images/
    reward("<image>how many red?", "2", "2")    -> 1.0

An image is 32x32 pixels: a 4x4 grid of 8x8 cells on black, 1 to 4 cells filled with a square of
red, green, blue or yellow. For the tiny Qwen2-VL (patch 8, merge 2) a cell is one vision patch and
an image is 4 image tokens. Each prompt is one `<image>` marker and one question:

    how many?         the number of squares                                  1..4
    how many COLOR?   the number of COLOR squares                            0..4
    color at R C?     the colour of the square in row R, column C (rows      red, green, blue,
                      from the top, columns from the left, 1..4; always a    yellow
                      filled cell, so "none" is never a free guess)

Answers are at most MAX_ANSWER_TOKENS tokens with the eos ("yellow"), so rollout needs
max_new_tokens >= 7.

Learnability (SFT of the tiny model on 4096 train prompts, batch 64, lr 1e-3, no clipping, ~0.11
s/step on 2 CPU cores; 3 seeds): counting is learned first, colour counts next, colour positions
slowly. Eval reward sampled at temperature 1 (greedy): 0.37-0.40 (0.47-0.53) after 200 steps,
0.43-0.64 (0.54-0.74) after 400, 0.53-0.71 (0.66-0.78) after 600 and still rising, so RL has
room above a 300-400 step warm start. lr 2e-3 trains unstably (loss spikes, 0.25 after 400 steps).

Image configurations are split into train and eval by a fixed hash, so evaluation never sees an
image layout used for SFT or RL. `reward` is the rule-based reward the multimodal config names by
dotted path (`stream_rlhf.data.shapes:reward`).
"""

from __future__ import annotations

import json
import random
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
from PIL import Image

Split = Literal["train", "eval"]
EVAL_EVERY = 10
"""One image configuration in EVAL_EVERY belongs to the eval split."""
GRID = 4
"""Cells per side."""
CELL = 8
"""Pixels per cell side; IMAGE_SIZE = GRID * CELL."""
IMAGE_SIZE = GRID * CELL
COLORS = {"red": (255, 0, 0), "green": (0, 200, 0), "blue": (0, 0, 255), "yellow": (255, 255, 0)}
MAX_SQUARES = 4
MAX_ANSWER_TOKENS = len("yellow") + 1


@dataclass(frozen=True)
class Problem:
    prompt: str
    answer: str
    squares: tuple[tuple[int, int, str], ...]
    """(row, column, colour) of each square, 0-based, sorted."""

    def image(self) -> Image.Image:
        """The 32x32 RGB image of `squares`."""
        pixels = np.zeros((IMAGE_SIZE, IMAGE_SIZE, 3), dtype=np.uint8)
        for row, column, color in self.squares:
            pixels[row * CELL:(row + 1) * CELL, column * CELL:(column + 1) * CELL] = COLORS[color]
        return Image.fromarray(pixels, "RGB")


def problems(split: Split, count: int, seed: int) -> list[Problem]:
    """`count` problems on images of `split`, drawn with `seed`."""
    rng = random.Random(f"shapes/{split}/{seed}")
    out = []
    while len(out) < count:
        squares = random_squares(rng)
        if split_of(squares) == split:
            out.append(_question(rng, squares))
    return out


def random_squares(rng: random.Random) -> tuple[tuple[int, int, str], ...]:
    """1 to MAX_SQUARES squares of random colours in distinct cells, sorted."""
    cells = rng.sample(range(GRID * GRID), rng.randint(1, MAX_SQUARES))
    return tuple(sorted((cell // GRID, cell % GRID, rng.choice(list(COLORS))) for cell in cells))


def _question(rng: random.Random, squares: tuple[tuple[int, int, str], ...]) -> Problem:
    kind = rng.randrange(3)
    if kind == 0:
        return Problem("<image>how many?", str(len(squares)), squares)
    if kind == 1:
        color = rng.choice(list(COLORS))
        return Problem(f"<image>how many {color}?", str(sum(c == color for _, _, c in squares)), squares)
    row, column, color = rng.choice(squares)  # always a filled cell: "none" would be a free guess
    return Problem(f"<image>color at {row + 1} {column + 1}?", color, squares)


def split_of(squares: tuple[tuple[int, int, str], ...]) -> Split:
    key = ",".join(f"{row}{column}{color}" for row, column, color in squares).encode()
    return "eval" if zlib.crc32(key) % EVAL_EVERY == 0 else "train"


def write_split(folder: str | Path, split: Split, count: int, seed: int,
                make: Callable[[Split, int, int], list[Problem]] = problems) -> Path:
    """Write `count` problems of `split` (made by `make(split, count, seed)`: this task's, or another
    task's on the same images) as `folder/{split}.jsonl` with PNGs in `folder/images/`."""
    folder = Path(folder)
    (folder / "images").mkdir(parents=True, exist_ok=True)
    lines = []
    for i, problem in enumerate(make(split, count, seed)):
        name = f"images/{split}-{i:06d}.png"
        problem.image().save(folder / name, compress_level=1)
        lines.append(json.dumps({"prompt": problem.prompt, "images": [name], "answer": problem.answer}) + "\n")
    path = folder / f"{split}.jsonl"
    path.write_text("".join(lines))
    return path


def read_squares(path: str | Path) -> tuple[tuple[int, int, str], ...]:
    """The squares of an image `Problem.image` drew (each cell's centre pixel: black, or a colour of
    COLORS), sorted as `Problem.squares`."""
    pixels = np.asarray(Image.open(path).convert("RGB"))
    by_rgb = {rgb: name for name, rgb in COLORS.items()}
    squares = []
    for row in range(GRID):
        for column in range(GRID):
            rgb = tuple(int(v) for v in pixels[row * CELL + CELL // 2, column * CELL + CELL // 2])
            if rgb in by_rgb:
                squares.append((row, column, by_rgb[rgb]))
            elif rgb != (0, 0, 0):
                raise ValueError(f"{path}: cell ({row}, {column}) has colour {rgb}, not a shapes task colour")
    return tuple(squares)


def reward(prompt: str, response: str, reference: str) -> float:
    """1.0 for the exact answer, 0.1 for an answer of the right kind (a digit for a count question,
    a colour word for a colour question), else 0."""
    text = response.strip()
    if text == reference:
        return 1.0
    right_kind = text in COLORS if reference in COLORS else len(text) == 1 and text.isdigit()
    return 0.1 if right_kind else 0.0
