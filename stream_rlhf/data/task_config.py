"""Config of where prompts come from: the synthetic task (`task`: arithmetic, shapes) or a JSONL
dataset (`data`), beside the code that makes and reads them (`arithmetic.py`, `shapes.py`,
`prompts_jsonl.py`)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

from stream_rlhf.config import ConfigError


@dataclass(frozen=True)
class TaskConfig:
    """The synthetic task: prompts, references and the split evaluation uses.

    arithmetic  "a+b=" prompts made in memory (text models); with `terms` > 2 the multi-step
                form "12+7+30=" answered with its partial sums "19,49", each a checkable step.
    shapes      coloured squares in 32x32 images with questions about them (vision-language
                models); written once as JSONL + PNG files under `data_dir` and read like `data`.
    """

    name: Literal["arithmetic", "shapes"] = "arithmetic"
    max_operand: int = 99
    """arithmetic: the largest operand."""
    terms: int = 2
    """arithmetic: operands per prompt; > 2 asks for every partial sum (the multi-step task)."""
    train_prompts: int = 4096
    """shapes: prompts written for the train split (RL and the warm start cycle over them)."""
    eval_prompts: int = 256
    seed: int = 0
    data_dir: str = "runs/.cache"
    """shapes: where the generated dataset is kept (a folder per task setting, reused by later runs)."""

    def __post_init__(self) -> None:
        if self.max_operand < 1:
            raise ConfigError(f"max_operand={self.max_operand}: must be >= 1")
        if self.terms < 2:
            raise ConfigError(f"terms={self.terms}: must be >= 2")
        if self.terms != 2 and self.name != "arithmetic":
            raise ConfigError(f"terms={self.terms}: only the arithmetic task has terms")
        if self.eval_prompts < 1 or self.train_prompts < 1:
            raise ConfigError(f"train_prompts={self.train_prompts}, eval_prompts={self.eval_prompts}: must be >= 1")


@dataclass(frozen=True)
class DataConfig:
    """A JSONL prompt dataset in place of the synthetic task's prompts, one object per line:

        {"prompt": "<image>how many red?", "images": ["images/1.png"], "answer": "2"}

    Relative image paths are relative to the JSONL file; each `<image>` marker in the prompt takes
    the next image (`images` may be absent for text-only lines). `answer` is the reference the
    reward function receives.
    """

    train: str | None = None
    """The RL (and warm-start) prompts; None: the synthetic task's."""
    eval: str | None = None
    """The held-out prompts of the before/after evaluation; required with `train`."""
    on_bad_sample: Literal["error", "skip"] = "error"
    """error: a bad line (unreadable JSON, missing or corrupt image, unsupported image size, image
    markers that do not match the images) stops the run naming file and line. skip: it is left
    out, counted by reason and reported in the summary."""
    min_pixels: int = 16 * 16
    """Images are resized (keeping their aspect ratio) to at least this many pixels..."""
    max_pixels: int = 448 * 448
    """...and at most this many, with sides rounded to the vision tower's patch grid."""
    max_images_per_prompt: int = 4

    def __post_init__(self) -> None:
        if (self.train is None) != (self.eval is None):
            raise ConfigError(f"train={self.train!r}, eval={self.eval!r}: give both or neither")
        for name in ("train", "eval"):
            path = getattr(self, name)
            if path is not None and not os.path.isfile(path):
                raise ConfigError(f"{name}={path!r}: no such file")
        if not 1 <= self.min_pixels <= self.max_pixels:
            raise ConfigError(f"min_pixels={self.min_pixels}, max_pixels={self.max_pixels}: need 1 <= min <= max")
        if self.max_images_per_prompt < 1:
            raise ConfigError(f"max_images_per_prompt={self.max_images_per_prompt}: must be >= 1")
