"""The prompt dataset of the multimodal prompt source: the rows of a JSONL file, a Parquet file or a
`datasets` folder (`rows.py`), each a conversation (`conversation.py`: today's form or the
conversational one) encoded with the chat template (`chat_template.py`).

    data = PromptDataset("data/train.parquet", tokenizer, spec, vision_token_ids, on_bad="skip",
                         max_images_per_prompt=1, seed=0, chat_template=None,
                         fields={"reference": "solution"}, system_prompt=None, tools=None)
    sample = data.next_sample()   # PromptSample: source, prompt, prompt_ids, images, answer, reward_kwargs

Rows are read, checked and their prompts encoded (one placeholder per image) when the dataset is
built, and every image path must name a file then; each distinct image (a file or inline bytes) is
decoded then too, once (`image_check.py`, cached by content in `image_cache`), so a corrupt or
unsupported image makes its rows bad before the run. Each image's placeholder is widened to its
image tokens when the row is sampled. A bad row raises `DataError` ("{source}: {reason}", the source "file:line" or
"file:row N"), or with on_bad="skip" is counted in `skipped` by kind and never tried again. The kinds:

    json           the line is not valid UTF-8 JSON
    schema         not an object, a missing or wrongly shaped field (named in the message), a
                   conversation the chat template (or its absence) cannot encode
    missing image  an image file does not exist (found when the dataset is built)
    corrupt image  an image cannot be decoded (truncated, not an image; found when the dataset is built)
    image size     an image size `load_image` does not support (see images.py)
    image tokens   images and image places (<image> markers, image parts, the template's
                   placeholders) differ in number, too many images, or the prompt text holds a
                   vision special token itself (or the model takes no images)

A whole-file problem (unreadable, empty, no usable row left) is a DataError of kind "file" whose
message starts with "{file}: ".
"""

from __future__ import annotations

import logging
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from transformers import PreTrainedTokenizerBase

from stream_rlhf.data.chat_template import (
    ConversationError,
    conversation_ids,
    conversation_text,
    expand_image_pads,
    turn_texts,
    writes_tools,
)
from stream_rlhf.data.conversation import PromptRow, parse_row
from stream_rlhf.data.errors import DataError
from stream_rlhf.data.image_check import bad_images
from stream_rlhf.data.images import ImageError, ImageSpec, PatchedImage, check_image_file, image_tokens, load_image
from stream_rlhf.data.rows import read_rows

log = logging.getLogger("stream_rlhf")

MAX_SKIPPED_EXAMPLES = 5
"""How many skipped lines keep their message in `PromptDataset.skipped_examples`."""


@dataclass
class PromptSample:
    source: str
    """Where the prompt comes from: "file:line" (JSONL, 1-based) or "file:row N" (0-based)."""
    prompt: str
    """The conversation's text, one turn a line, images as <image> markers (today's form: its prompt)."""
    prompt_ids: torch.Tensor
    """(L,) long: the encoded prompt, image pads included."""
    images: list[PatchedImage]
    answer: str
    """The reference the reward function receives."""
    image_paths: tuple[str, ...] = ()
    """The images' files, in prompt order ("{source} bytes of FIELD" for an image held in the row:
    the sample log's viewer shows that name where it has no file to show)."""
    reward_kwargs: dict = field(default_factory=dict)
    """The extra columns `data.fields` names, by keyword of the reward function."""


@dataclass(frozen=True)
class _Line:
    row: PromptRow
    ids: tuple[int, ...]
    """The prompt ids with one image pad per image (widened when sampled)."""


class PromptDataset:
    """The rows of a prompt dataset, served in a seeded shuffled order epoch after epoch.

    `spec` and `vision_token_ids` are both None for a text-only model: a row with images is then
    bad ("image tokens"). `chat_template` is the Jinja text (None: the prompt as written,
    `chat_template.py`); `fields` is `data.fields`; `system_prompt` becomes the first turn of a
    conversation that has no system turn. `sample(index)` raises DataError for a bad row whatever
    `on_bad` says; `next_sample()` applies `on_bad`. `image_cache`: the folder of the image decode
    cache (`image_check.py`; None: none)."""

    def __init__(
        self,
        path: str | Path,
        tokenizer: PreTrainedTokenizerBase,
        spec: ImageSpec | None,
        vision_token_ids: tuple[int, int, int] | None,
        on_bad: Literal["error", "skip"],
        max_images_per_prompt: int,
        seed: int,
        chat_template: str | None = None,
        fields: dict[str, str] | None = None,
        system_prompt: str | None = None,
        image_cache: Path | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> None:
        if on_bad not in ("error", "skip"):
            raise ValueError(f"on_bad={on_bad!r}: must be 'error' or 'skip'")
        if tools and chat_template is None:
            raise ValueError("tools: the chat template writes them into the prompts, and there is none")
        if tools and not writes_tools(tokenizer, chat_template, tools):
            log.warning("the chat template writes no tools into the prompts: the policy is not told of env.tools")
        if max_images_per_prompt < 0:
            raise ValueError(f"max_images_per_prompt={max_images_per_prompt}: must be >= 0")
        self.file, self.tokenizer, self.spec = str(path), tokenizer, spec
        if (spec is None) != (vision_token_ids is None):
            raise ValueError("spec and vision_token_ids: give both (a vision-language model) or neither (text)")
        self.vision_token_ids = None if vision_token_ids is None else tuple(vision_token_ids)
        self.image_pad_id = None if vision_token_ids is None else vision_token_ids[1]
        self.on_bad, self.max_images_per_prompt, self.seed = on_bad, max_images_per_prompt, seed
        self.chat_template, self.fields, self.system_prompt = chat_template, dict(fields or {}), system_prompt
        self.tools = tools
        self._vision_texts = () if vision_token_ids is None else tuple(
            tokenizer.convert_ids_to_tokens(list(vision_token_ids)))
        self.skipped: dict[str, int] = {}
        """Bad rows skipped so far, by kind (on_bad="skip")."""
        self.skipped_examples: list[str] = []
        """The messages of the first MAX_SKIPPED_EXAMPLES skipped rows."""
        self.epoch = 0
        """Completed passes over the dataset by `next_sample`."""
        self._bad: set[int] = set()
        folder = Path(path) if Path(path).is_dir() else Path(path).parent
        rows = read_rows(path)
        self.sources: list[str] = [source for source, _ in rows]
        """The source of each row ("file:line" or "file:row N"); `sample(index)` indexes this list."""
        self._lines: list[_Line | DataError] = [
            record if isinstance(record, DataError) else self._parse(source, record, folder)
            for source, record in rows]
        if spec is not None:
            self._decode_images(image_cache)
        for index, line in enumerate(self._lines):
            if isinstance(line, DataError):
                self._reject(index, line)
        self._order = self._shuffled(0)
        self._position = 0

    def __len__(self) -> int:
        return len(self._lines)

    def sample(self, index: int) -> PromptSample:
        """Row `index` with its images decoded and its prompt encoded; raises DataError if it is bad."""
        line, source = self._lines[index], self.sources[index]
        if isinstance(line, DataError):
            raise line
        images = []
        for image in line.row.images:
            try:
                images.append(load_image(image.source, self.spec))
            except ImageError as error:
                raise DataError(source, error.kind, f"image {image.name}: {error.reason}") from None
        ids = expand_image_pads(list(line.ids), self.image_pad_id, [image.num_tokens for image in images])
        return PromptSample(source, conversation_text(line.row.turns), ids, images, line.row.reference,
                            tuple(f"{source} {image.name}" if isinstance(image.source, bytes) else str(image.source)
                                  for image in line.row.images), dict(line.row.reward_kwargs))

    def longest_prompt(self) -> tuple[int, str]:
        """(tokens, source) of the longest prompt among the rows not found bad, images counted from
        their headers (an image whose header does not read counts as one token: its decode says
        why when the row is sampled)."""
        longest = (0, self.file)
        for index, line in enumerate(self._lines):
            if index in self._bad or isinstance(line, DataError):
                continue
            images = sum(image_tokens(image.source, self.spec) or 1 for image in line.row.images)
            tokens = len(line.ids) - len(line.row.images) + images
            longest = max(longest, (tokens, self.sources[index]), key=lambda pair: pair[0])
        return longest

    def next_sample(self) -> PromptSample:
        """The next good line in this epoch's shuffled order; a new shuffle starts each epoch."""
        while True:
            self._check_usable()
            if self._position == len(self._order):
                self.epoch += 1
                self._order, self._position = self._shuffled(self.epoch), 0
            index = self._order[self._position]
            self._position += 1
            if (sample := self._good_sample(index)) is not None:
                return sample

    def each_sample(self) -> Iterator[PromptSample]:
        """Every good line once, in file order (evaluation); bad lines as in `next_sample`."""
        for index in range(len(self._lines)):
            if (sample := self._good_sample(index)) is not None:
                yield sample

    def _good_sample(self, index: int) -> PromptSample | None:
        """Line `index` loaded, or None when it is (now found) bad and skipped; raises in error mode."""
        if index in self._bad:
            return None
        try:
            return self.sample(index)
        except DataError as error:
            self._reject(index, error)
            return None

    def _reject(self, index: int, error: DataError) -> None:
        if self.on_bad == "error":
            raise error
        self._bad.add(index)
        self.skipped[error.kind] = self.skipped.get(error.kind, 0) + 1
        if len(self.skipped_examples) < MAX_SKIPPED_EXAMPLES:
            self.skipped_examples.append(str(error))
        self._check_usable()

    def _check_usable(self) -> None:
        if len(self._bad) == len(self._lines):
            summary = ", ".join(f"{count} {kind}" for kind, count in sorted(self.skipped.items()))
            raise DataError(self.file, "file", f"no usable rows in {self.file} ({len(self._bad)} skipped: {summary})")

    def cursor(self) -> dict[str, object]:
        """Where `next_sample` stands: what `seek` takes to continue from here (JSON values)."""
        return {"epoch": self.epoch, "position": self._position, "bad": sorted(self._bad),
                "skipped": dict(self.skipped), "skipped_examples": list(self.skipped_examples)}

    def seek(self, cursor: dict) -> None:
        """Continue from a `cursor()` of a dataset over the same file and seed."""
        if not 0 <= cursor["position"] <= len(self._lines) or any(not 0 <= i < len(self._lines) for i in cursor["bad"]):
            raise ValueError(f"{self.file}: a cursor of another file ({len(self._lines)} lines here): {cursor}")
        self.epoch, self._position = cursor["epoch"], cursor["position"]
        self._order = self._shuffled(self.epoch)
        self._bad = set(cursor["bad"])
        self.skipped, self.skipped_examples = dict(cursor["skipped"]), list(cursor["skipped_examples"])

    def _shuffled(self, epoch: int) -> list[int]:
        order = list(range(len(self._lines)))
        random.Random(f"{self.seed}/{epoch}").shuffle(order)
        return order

    def _decode_images(self, cache_dir: Path | None) -> None:
        """A line naming an image that does not decode (or has an unsupported size) becomes bad."""
        images = [image for line in self._lines if isinstance(line, _Line) for image in line.row.images]
        bad = bad_images((image.source for image in images), self.spec, cache_dir)
        for index, line in enumerate(self._lines):
            if not isinstance(line, _Line):
                continue
            named = [(image.name, bad[image.source]) for image in line.row.images if image.source in bad]
            if named:
                name, error = named[0]
                self._lines[index] = DataError(self.sources[index], error.kind, f"image {name}: {error.reason}")

    def _parse(self, source: str, record: dict, folder: Path) -> _Line | DataError:
        """The row's checks (shape, images, encoding); a DataError instead of raising."""
        try:
            row = parse_row(source, record, folder, self.fields)
        except DataError as error:
            return error
        turns = row.turns
        if self.system_prompt is not None and turns[0]["role"] != "system":
            turns = ({"role": "system", "content": self.system_prompt}, *turns)
        if row.images and self.spec is None:
            return DataError(source, "image tokens", "prompt has images but the model takes none (no vision tower)")
        if len(row.images) > self.max_images_per_prompt:
            return DataError(source, "image tokens",
                             f"too many images: {len(row.images)} > max_images_per_prompt={self.max_images_per_prompt}")
        for special in self._vision_texts:
            if any(special in text for text in turn_texts(turns)):
                return DataError(source, "image tokens", f"prompt text contains the special token {special} "
                                 "(write images as <image> markers or image parts)")
        for image in row.images:
            if isinstance(image.source, Path):
                try:
                    check_image_file(image.source)
                except ImageError as error:
                    return DataError(source, error.kind, f"image {image.name}: {error.reason}")
        try:
            ids = conversation_ids(self.tokenizer, self.chat_template, turns, self.vision_token_ids, self.tools)
        except ConversationError as error:
            return DataError(source, "schema", str(error))
        except ValueError as error:  # images and their places disagree
            return DataError(source, "image tokens", str(error))
        return _Line(row, tuple(ids))
