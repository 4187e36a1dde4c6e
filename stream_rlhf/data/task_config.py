"""Config of where prompts come from: the synthetic task (`task`: arithmetic, tool_sums, shapes,
shapes_dialogue) or a dataset (`data`: JSONL, Parquet, a `datasets` folder), beside the code that
makes and reads them (`arithmetic.py`, `tool_sums.py`, `shapes.py`, `shapes_dialogue.py`,
`prompts_jsonl.py`)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Annotated, Literal

from msgspec import Meta

from stream_rlhf.config import ConfigError, check_fields


@dataclass(frozen=True)
class TaskConfig:
    """The synthetic task: prompts, references and the split evaluation uses.

    arithmetic  "a+b=" prompts made in memory (text models); with `terms` > 2 the multi-step
                form "12+7+30=" answered with its partial sums "19,49", each a checkable step.
    tool_sums   sums of 3 or 4 operands up to `max_operand` answered with the sum, for a policy
                with the calculator tool (`env.factory: stream_rlhf.envs.calculator:Calculator`);
                the warm start shows the tool on `tool_fraction` of its demonstrations.
    shapes      coloured squares in 32x32 images with questions about them (vision-language
                models); written once as JSONL + PNG files under `data_dir` and read like `data`.
    shapes_dialogue  the shapes images with two questions, the second about the colour the first
                answer named (`env.factory: stream_rlhf.envs.shapes_dialogue:ShapesDialogue`);
                written and read like shapes; the warm start demonstrates both turns.
    """

    name: Literal["arithmetic", "tool_sums", "shapes", "shapes_dialogue"] = "arithmetic"
    """Which synthetic task (see above); with `data.train` set, its prompts replace the task's."""
    max_operand: Annotated[int, Meta(ge=1)] = 99
    """arithmetic, tool_sums: the largest operand."""
    terms: Annotated[int, Meta(ge=2)] = 2
    """arithmetic: operands per prompt; > 2 asks for every partial sum (the multi-step task)."""
    tool_fraction: Annotated[float, Meta(ge=0, le=1)] = 0.5
    """tool_sums: the share of warm-start demonstrations that call the calculator and then answer
    (the others answer directly)."""
    train_prompts: Annotated[int, Meta(ge=1)] = 4096
    """shapes, shapes_dialogue: prompts written for the train split (RL and the warm start cycle over them)."""
    eval_prompts: Annotated[int, Meta(ge=1)] = 256
    """Prompts of the held-out split that the before/after evaluation scores."""
    seed: int = 0
    """Seed of the generated prompts (the train split, the held-out split and the warm start's
    examples each derive their own from it)."""
    data_dir: str = "runs/.cache"
    """shapes, shapes_dialogue: where the generated dataset is kept (a folder per task setting, reused by later runs);
    any dataset: where the outcome of each image's decode is kept, by content (`image_check.json`)."""

    def __post_init__(self) -> None:
        check_fields(self)
        if self.terms != 2 and self.name != "arithmetic":
            raise ConfigError(f"terms={self.terms}: only the arithmetic task has terms")
        if self.tool_fraction != TaskConfig.tool_fraction and self.name != "tool_sums":
            raise ConfigError(f"tool_fraction={self.tool_fraction}: only the tool_sums task has it")


@dataclass(frozen=True)
class DataConfig:
    """A prompt dataset in place of the synthetic task's prompts: a JSONL file, a Parquet file
    (`.parquet`) or a `datasets` folder (`save_to_disk`), each row a conversation or a prompt text
    (docs/data.md has the forms, the image encodings and how `fields` and `chat_template` apply).

        {"prompt": "<image>how many red?", "images": ["images/1.png"], "answer": "2"}
        {"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "how many?"}]}],
         "images": ["images/1.png"], "answer": "2"}

    Relative image paths are relative to the dataset's folder.
    """

    train: str | None = None
    """The RL (and warm-start) prompts; None: the synthetic task's."""
    eval: str | None = None
    """The held-out prompts of the before/after evaluation; required with `train`."""
    on_bad_sample: Literal["error", "skip"] = "error"
    """error: a bad row (unreadable JSON, a missing or wrongly shaped field, a missing or corrupt
    image, an unsupported image size, images that do not match their places) stops the run naming
    file, row and field. skip: it is left out, counted by reason and reported in the summary."""
    fields: dict[str, str] = field(default_factory=dict)
    """Columns by role: `reference` names the reward's reference (default `answer`; a dotted name
    reaches into a struct: `reward_model.ground_truth`); every other entry `NAME: COLUMN` passes
    the column to the reward function as keyword argument NAME."""
    chat_template: str = "auto"
    """How a conversation becomes the prompt: auto (the tokenizer's chat template when it has one,
    else none), none (the text as written after a bos; a conversation must be one user turn), or
    the path of a Jinja template file. The prompt ends with the template's generation prompt."""
    system_prompt: str | None = None
    """A system turn put first in every conversation that has none (needs a chat template)."""
    min_pixels: Annotated[int, Meta(ge=1)] | None = None
    """Images are resized (keeping their aspect ratio) to at least this many pixels...; None: the
    model folder's preprocessor_config.json, else 16 * 16."""
    max_pixels: int | None = None
    """...and at most this many, with sides rounded to the vision tower's patch grid; None: the
    model folder's preprocessor_config.json, else 448 * 448."""
    max_images_per_prompt: Annotated[int, Meta(ge=1)] = 4
    """A row with more images than this is a bad sample (see `on_bad_sample`); vLLM sizes its
    multimodal inputs by it."""

    def __post_init__(self) -> None:
        check_fields(self)
        if (self.train is None) != (self.eval is None):
            raise ConfigError(f"train={self.train!r}, eval={self.eval!r}: give both or neither")
        for name in ("train", "eval"):
            path = getattr(self, name)
            if path is not None and not os.path.exists(path):
                raise ConfigError(f"{name}={path!r}: no such file or folder")
        if self.chat_template not in ("auto", "none") and not os.path.isfile(self.chat_template):
            raise ConfigError(f"chat_template={self.chat_template!r}: auto, none or a template file (no such file)")
        for name, column in self.fields.items():
            if not name.isidentifier() or not column or "" in column.split("."):
                raise ConfigError(f"fields.{name}={column!r}: need a keyword name and a (dotted) column name")
        if self.system_prompt is not None and self.chat_template == "none":
            raise ConfigError("system_prompt: needs a chat template (chat_template=none)")
        if self.min_pixels is not None and self.max_pixels is not None and self.min_pixels > self.max_pixels:
            raise ConfigError(f"min_pixels={self.min_pixels}, max_pixels={self.max_pixels}: need 1 <= min <= max")
