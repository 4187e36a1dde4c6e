"""Prompts with images from a JSONL file, for the multimodal prompt source.

One JSON object per line (blank lines are ignored):

    {"prompt": "<image>how many red?", "images": ["images/000001.png"], "answer": "2"}

`prompt` (a non-empty string) and `answer` (a string, the reward's reference) are required;
`images` (a list of paths) is optional, and no other key is allowed. Relative image paths resolve
against the folder of the JSONL file. Each `<image>` marker in `prompt` stands for the next image
of `images`; it becomes `<|vision_start|>`, one `<|image_pad|>` per image token, `<|vision_end|>`.
The prompt text goes to the model as written (a leading bos where the tokenizer has one, no chat
template).

    data = PromptDataset("data/train.jsonl", tokenizer, spec, vision_token_ids, on_bad="skip",
                         max_images_per_prompt=1, seed=0)
    sample = data.next_sample()   # PromptSample: source, prompt, prompt_ids, images, answer

Lines are read and checked as text when the dataset is built, and every image path must name a
file then; each distinct image file is decoded then too, once (`image_check.py`, cached by content
in `image_cache`), so a corrupt or unsupported image makes its lines bad before the run. A bad
line raises `DataError` ("{file}:{line}: {reason}"), or with on_bad="skip" is counted in
`skipped` by kind and never tried again. The kinds (all found when the dataset is built):

    json           the line is not valid UTF-8 JSON
    schema         not an object, a missing / unknown / wrongly typed key
    missing image  an image file does not exist
    corrupt image  an image file cannot be decoded (truncated, not an image)
    image size     an image size `load_image` does not support (see images.py)
    image tokens   <image> markers do not match the images, too many images, or the prompt text
                   holds a vision special token itself (or the model takes no images)

A whole-file problem (unreadable, empty, no usable line left) is a DataError of kind "file" whose
message starts with "{file}: ".
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from transformers import PreTrainedTokenizerBase

from stream_rlhf.data.errors import DataError
from stream_rlhf.data.image_check import bad_images
from stream_rlhf.data.images import ImageError, ImageSpec, PatchedImage, check_image_file, image_tokens, load_image

IMAGE_MARKER = "<image>"
KEYS = ("prompt", "images", "answer")
MAX_SKIPPED_EXAMPLES = 5
"""How many skipped lines keep their message in `PromptDataset.skipped_examples`."""


@dataclass
class PromptSample:
    source: str
    """Where the prompt comes from: "file:line" (1-based)."""
    prompt: str
    """The prompt text, with its <image> markers."""
    prompt_ids: torch.Tensor
    """(L,) long: the encoded prompt, image pads included."""
    images: list[PatchedImage]
    answer: str
    image_paths: tuple[str, ...] = ()
    """The files of `images`, in prompt order."""


def encode_prompt(
    tokenizer: PreTrainedTokenizerBase,
    text: str,
    image_token_counts: list[int],
    vision_token_ids: tuple[int, int, int] | None,
) -> torch.Tensor:
    """(L,) long ids: bos (if the tokenizer has one), then the text with each <image> marker replaced by
    vision_start, image_pad * n, vision_end (n = the next of `image_token_counts`).

    `vision_token_ids` is (vision_start, image_pad, vision_end), e.g. a Qwen2-VL config's
    (vision_start_token_id, image_token_id, vision_end_token_id); None for a text-only model (then no
    markers). Raises ValueError when the markers and counts differ in number, a count is < 1, or the
    text itself encodes to a vision token."""
    segments = text.split(IMAGE_MARKER)
    if len(segments) - 1 != len(image_token_counts):
        raise ValueError(f"prompt has {len(segments) - 1} {IMAGE_MARKER} markers "
                         f"for {len(image_token_counts)} image(s)")
    if vision_token_ids is None and image_token_counts:
        raise ValueError("prompt has images but the model takes none (no vision tower)")
    start, pad, end = vision_token_ids or (None, None, None)
    ids = [] if tokenizer.bos_token_id is None else [tokenizer.bos_token_id]
    for i, segment in enumerate(segments):
        if i > 0:
            count = image_token_counts[i - 1]
            if count < 1:
                raise ValueError(f"image {i} has {count} image tokens, expected >= 1")
            ids += [start] + [pad] * count + [end]
        segment_ids = tokenizer.encode(segment, add_special_tokens=False) if segment else []
        if vision_token_ids is not None and set(segment_ids) & {start, pad, end}:
            raise ValueError("prompt text contains a vision special token (write images as <image> markers)")
        ids += segment_ids
    return torch.tensor(ids, dtype=torch.long)


@dataclass(frozen=True)
class _Line:
    prompt: str
    image_names: tuple[str, ...]
    """As written in the file (for messages)."""
    image_paths: tuple[Path, ...]
    answer: str


class PromptDataset:
    """The lines of a JSONL prompt file, served in a seeded shuffled order epoch after epoch.

    `spec` and `vision_token_ids` are both None for a text-only model: a line with images is then
    bad ("image tokens"). `sample(index)` raises DataError for a bad line whatever `on_bad` says;
    `next_sample()` applies `on_bad`. `image_cache`: the folder of the image decode cache
    (`image_check.py`; None: none)."""

    def __init__(
        self,
        path: str | Path,
        tokenizer: PreTrainedTokenizerBase,
        spec: ImageSpec | None,
        vision_token_ids: tuple[int, int, int] | None,
        on_bad: Literal["error", "skip"],
        max_images_per_prompt: int,
        seed: int,
        image_cache: Path | None = None,
    ) -> None:
        if on_bad not in ("error", "skip"):
            raise ValueError(f"on_bad={on_bad!r}: must be 'error' or 'skip'")
        if max_images_per_prompt < 0:
            raise ValueError(f"max_images_per_prompt={max_images_per_prompt}: must be >= 0")
        self.file, self.tokenizer, self.spec = str(path), tokenizer, spec
        if (spec is None) != (vision_token_ids is None):
            raise ValueError("spec and vision_token_ids: give both (a vision-language model) or neither (text)")
        self.vision_token_ids = None if vision_token_ids is None else tuple(vision_token_ids)
        self.on_bad, self.max_images_per_prompt, self.seed = on_bad, max_images_per_prompt, seed
        self._vision_texts = () if vision_token_ids is None else tuple(
            tokenizer.convert_ids_to_tokens(list(vision_token_ids)))
        self.skipped: dict[str, int] = {}
        """Bad lines skipped so far, by kind (on_bad="skip")."""
        self.skipped_examples: list[str] = []
        """The messages of the first MAX_SKIPPED_EXAMPLES skipped lines."""
        self.epoch = 0
        """Completed passes over the file by `next_sample`."""
        self._bad: set[int] = set()
        try:
            raw_lines = Path(path).read_bytes().split(b"\n")
        except OSError as error:
            raise DataError(self.file, "file", f"cannot be read ({error.strerror or error})") from None
        folder = Path(path).parent
        self.sources: list[str] = []
        """ "file:line" of each non-blank line; `sample(index)` indexes this list."""
        self._lines: list[_Line | DataError] = []
        for number, raw in enumerate(raw_lines, start=1):
            if raw.strip():
                self.sources.append(f"{self.file}:{number}")
                self._lines.append(self._parse(self.sources[-1], raw, folder))
        if not self._lines:
            raise DataError(self.file, "file", "no lines (the file is empty)")
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
        """Line `index` with its images decoded and its prompt encoded; raises DataError if it is bad."""
        line, source = self._lines[index], self.sources[index]
        if isinstance(line, DataError):
            raise line
        images = []
        for name, path in zip(line.image_names, line.image_paths):
            try:
                images.append(load_image(path, self.spec))
            except ImageError as error:
                raise DataError(source, error.kind, f"image {name}: {error.reason}") from None
        try:
            ids = encode_prompt(self.tokenizer, line.prompt, [image.num_tokens for image in images],
                                self.vision_token_ids)
        except ValueError as error:
            raise DataError(source, "image tokens", str(error)) from None
        return PromptSample(source, line.prompt, ids, images, line.answer, tuple(map(str, line.image_paths)))

    def longest_prompt(self) -> tuple[int, str]:
        """(tokens, source) of the longest prompt among the lines not found bad, images counted from
        their headers (an image whose header does not read counts as one token: its decode says
        why when the line is sampled)."""
        longest = (0, self.file)
        bos = 0 if self.tokenizer.bos_token_id is None else 1
        for index, line in enumerate(self._lines):
            if index in self._bad or isinstance(line, DataError):
                continue
            text = sum(len(self.tokenizer.encode(segment, add_special_tokens=False))
                       for segment in line.prompt.split(IMAGE_MARKER) if segment)
            images = sum(2 + (image_tokens(path, self.spec) or 1) for path in line.image_paths)
            longest = max(longest, (bos + text + images, self.sources[index]), key=lambda pair: pair[0])
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
            raise DataError(self.file, "file", f"no usable lines in {self.file} ({len(self._bad)} skipped: {summary})")

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
        bad = bad_images((p for line in self._lines if isinstance(line, _Line) for p in line.image_paths), self.spec,
                         cache_dir)
        for index, line in enumerate(self._lines):
            if not isinstance(line, _Line):
                continue
            named = [(name, bad[path]) for name, path in zip(line.image_names, line.image_paths) if path in bad]
            if named:
                name, error = named[0]
                self._lines[index] = DataError(self.sources[index], error.kind, f"image {name}: {error.reason}")

    def _parse(self, source: str, raw: bytes, folder: Path) -> _Line | DataError:
        """The line's text checks (JSON, keys, types, markers); a DataError instead of raising."""
        try:
            record = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            return DataError(source, "json", f"not valid JSON ({error})")
        if not isinstance(record, dict):
            return DataError(source, "schema", f"expected a JSON object, got {type(record).__name__}")
        for key in record:
            if key not in KEYS:
                return DataError(source, "schema", f'unknown key "{key}" (allowed: {", ".join(KEYS)})')
        for key in ("prompt", "answer"):
            if key not in record:
                return DataError(source, "schema", f'missing key "{key}"')
            if not isinstance(record[key], str):
                return DataError(source, "schema", f'key "{key}" must be a string, got {type(record[key]).__name__}')
        prompt, names = record["prompt"], record.get("images", [])
        if not prompt:
            return DataError(source, "schema", 'key "prompt" is empty')
        if not isinstance(names, list) or not all(isinstance(name, str) and name for name in names):
            return DataError(source, "schema", 'key "images" must be a list of non-empty path strings')
        markers = prompt.count(IMAGE_MARKER)
        if markers != len(names):
            return DataError(source, "image tokens",
                             f"prompt has {markers} {IMAGE_MARKER} markers for {len(names)} image(s)")
        if names and self.spec is None:
            return DataError(source, "image tokens", "prompt has images but the model takes none (no vision tower)")
        if len(names) > self.max_images_per_prompt:
            return DataError(source, "image tokens",
                             f"too many images: {len(names)} > max_images_per_prompt={self.max_images_per_prompt}")
        for text in self._vision_texts:
            if text in prompt:
                return DataError(source, "image tokens", f"prompt text contains the special token {text} "
                                 "(write images as <image> markers)")
        paths = tuple(Path(name) if Path(name).is_absolute() else folder / name for name in names)
        for name, path in zip(names, paths):
            try:
                check_image_file(path)
            except ImageError as error:
                return DataError(source, error.kind, f"image {name}: {error.reason}")
        return _Line(prompt, tuple(names), paths, record["answer"])
