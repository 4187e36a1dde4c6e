"""Config of where prompts come from: the synthetic task (`task`: arithmetic, shapes) or a JSONL
dataset (`data`), beside the code that makes and reads them (`arithmetic.py`, `shapes.py`,
`prompts_jsonl.py`)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Annotated, Literal

from msgspec import Meta

from stream_rlhf.config import ConfigError, check_fields


@dataclass(frozen=True)
class TaskConfig:
    """The synthetic task: prompts, references and the split evaluation uses.

    arithmetic  "a+b=" prompts made in memory (text models); with `terms` > 2 the multi-step
                form "12+7+30=" answered with its partial sums "19,49", each a checkable step.
    shapes      coloured squares in 32x32 images with questions about them (vision-language
                models); written once as JSONL + PNG files under `data_dir` and read like `data`.
    """

    name: Literal["arithmetic", "shapes"] = "arithmetic"
    """Which synthetic task (see above); with `data.train` set, its prompts replace the task's."""
    max_operand: Annotated[int, Meta(ge=1)] = 99
    """arithmetic: the largest operand."""
    terms: Annotated[int, Meta(ge=2)] = 2
    """arithmetic: operands per prompt; > 2 asks for every partial sum (the multi-step task)."""
    train_prompts: Annotated[int, Meta(ge=1)] = 4096
    """shapes: prompts written for the train split (RL and the warm start cycle over them)."""
    eval_prompts: Annotated[int, Meta(ge=1)] = 256
    """Prompts of the held-out split that the before/after evaluation scores."""
    seed: int = 0
    """Seed of the generated prompts (the train split, the held-out split and the warm start's
    examples each derive their own from it)."""
    data_dir: str = "runs/.cache"
    """shapes: where the generated dataset is kept (a folder per task setting, reused by later runs);
    any dataset: where the outcome of each image's decode is kept, by content (`image_check.json`)."""

    def __post_init__(self) -> None:
        check_fields(self)
        if self.terms != 2 and self.name != "arithmetic":
            raise ConfigError(f"terms={self.terms}: only the arithmetic task has terms")


@dataclass(frozen=True)
class DataConfig:
    """A JSONL prompt dataset in place of the synthetic task's prompts.

    One object per line:

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
    min_pixels: Annotated[int, Meta(ge=1)] = 16 * 16
    """Images are resized (keeping their aspect ratio) to at least this many pixels..."""
    max_pixels: int = 448 * 448
    """...and at most this many, with sides rounded to the vision tower's patch grid."""
    max_images_per_prompt: Annotated[int, Meta(ge=1)] = 4
    """A line with more images than this is a bad sample (see `on_bad_sample`); vLLM sizes its
    multimodal inputs by it."""

    def __post_init__(self) -> None:
        check_fields(self)
        if (self.train is None) != (self.eval is None):
            raise ConfigError(f"train={self.train!r}, eval={self.eval!r}: give both or neither")
        for name in ("train", "eval"):
            path = getattr(self, name)
            if path is not None and not os.path.isfile(path):
                raise ConfigError(f"{name}={path!r}: no such file")
        if self.min_pixels > self.max_pixels:
            raise ConfigError(f"min_pixels={self.min_pixels}, max_pixels={self.max_pixels}: need 1 <= min <= max")
