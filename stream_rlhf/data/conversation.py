"""One dataset row as a conversation: its turns, its images, the reward's reference and the extra
columns the reward function takes. The row forms (any of them in JSONL, Parquet or a `datasets`
folder; `rows.py` reads them):

    today's form      {"prompt": "<image>how many?", "images": ["1.png"], "answer": "2"}
                      each <image> marker takes the next of `images`
    conversational    {"messages": [{"role": "user", "content": [{"type": "image"},
                                                                  {"type": "text", "text": "how many?"}]}],
                       "images": ["1.png"], "answer": "2"}
                      `prompt` may hold the turns instead of `messages` (TRL's and verl's name);
                      content is a string or a list of parts; an image part holds its image
                      (`image` or `path`) or takes the next of `images`

An image is a path (relative to the dataset's folder), bytes, or `{"bytes", "path"}` as Parquet and
`datasets` store an image column (the bytes win when both are set). The reference is the column
`data.fields.reference` names (default `answer`; a dotted name reaches into a struct column:
`reward_model.ground_truth`); a string or a number. Every other `data.fields` entry names a column
whose value (JSON-like) reaches the reward function as the keyword argument of the entry's name.
Columns nothing names are ignored.

    row = parse_row(source, record, folder, {"reference": "solution"})   # PromptRow, raises DataError
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stream_rlhf.data.errors import DataError

IMAGE_MARKER = "<image>"
REFERENCE = "reference"
"""The `data.fields` key of the reward's reference column."""
DEFAULT_REFERENCE_COLUMN = "answer"
ImageSource = Path | bytes


@dataclass(frozen=True)
class ImageRef:
    name: str
    """The image as messages name it: its path as written, or "bytes of FIELD" for inline bytes."""
    source: ImageSource
    """A file (resolved against the dataset's folder) or the encoded image itself."""


@dataclass(frozen=True)
class PromptRow:
    turns: tuple[dict[str, Any], ...]
    """{"role", "content"}; content a string or a list of {"type": "text", "text"} and
    {"type": "image"} parts (the image parts in the order of `images`), as chat templates take them."""
    images: tuple[ImageRef, ...]
    reference: str
    reward_kwargs: dict[str, Any]
    """Extra columns by keyword (`data.fields` beside `reference`), JSON-like values."""


def parse_row(source: str, record: dict[str, Any], folder: Path, fields: dict[str, str]) -> PromptRow:
    """The row `record` (from `source`, a dataset in `folder`) as a PromptRow; a DataError of kind
    "schema" naming the field when its shape is none of the forms above, or "image tokens" when
    its images and image places differ in number."""
    named_images = _images_column(source, record, folder)
    if "messages" in record and record["messages"] is not None:
        turns, images = _turns(source, "messages", record["messages"], named_images, folder)
    elif isinstance(record.get("prompt"), list):
        turns, images = _turns(source, "prompt", record["prompt"], named_images, folder)
    elif isinstance(record.get("prompt"), str):
        turns, images = _marked_prompt(source, record["prompt"], named_images)
    elif "prompt" in record:
        raise DataError(source, "schema", f'field "prompt": expected a string or a list of turns, '
                        f"got {type(record['prompt']).__name__}")
    else:
        raise DataError(source, "schema", 'no "messages" or "prompt" field (the conversation or the prompt text)')
    reference_column = fields.get(REFERENCE, DEFAULT_REFERENCE_COLUMN)
    reference = _column(source, record, reference_column, "reference")
    if isinstance(reference, bool) or not isinstance(reference, str | int | float):
        raise DataError(source, "schema", f'field "{reference_column}" (the reference) must be a string or a '
                        f"number, got {type(reference).__name__}")
    kwargs = {name: _json_value(source, column, _column(source, record, column, name))
              for name, column in fields.items() if name != REFERENCE}
    return PromptRow(turns, images, str(reference), kwargs)


def _images_column(source: str, record: dict[str, Any], folder: Path) -> list[ImageRef]:
    names = record.get("images")
    if names is None:
        return []
    if not isinstance(names, list):
        raise DataError(source, "schema", 'field "images" must be a list of images (paths, bytes or {bytes, path})')
    return [_image(source, f"images[{i}]", value, folder) for i, value in enumerate(names)]


def _image(source: str, field: str, value: Any, folder: Path) -> ImageRef:
    if isinstance(value, dict):
        data, path = value.get("bytes"), value.get("path")
        if data is not None:
            return _image(source, field, data, folder)
        if path is not None:
            return _image(source, field, path, folder)
        raise DataError(source, "schema", f'field "{field}": an image with neither bytes nor path')
    if isinstance(value, bytes | bytearray) and value:
        return ImageRef(f"bytes of {field}", bytes(value))
    if isinstance(value, str) and value:
        return ImageRef(value, Path(value) if Path(value).is_absolute() else folder / value)
    raise DataError(source, "schema", f'field "{field}": an image must be a path, bytes or {{bytes, path}}, '
                    f"got {type(value).__name__}")


def _marked_prompt(source: str, prompt: str, images: list[ImageRef]) -> tuple[tuple[dict, ...], tuple[ImageRef, ...]]:
    """Today's form: one user turn, each <image> marker an image part."""
    if not prompt:
        raise DataError(source, "schema", 'field "prompt" is empty')
    markers = prompt.count(IMAGE_MARKER)
    if markers != len(images):
        raise DataError(source, "image tokens",
                        f"prompt has {markers} {IMAGE_MARKER} markers for {len(images)} image(s)")
    parts: list[dict[str, Any]] = []
    for i, text in enumerate(prompt.split(IMAGE_MARKER)):
        if i > 0:
            parts.append({"type": "image"})
        if text:
            parts.append({"type": "text", "text": text})
    return ({"role": "user", "content": parts},), tuple(images)


def _turns(source: str, field: str, value: list, named_images: list[ImageRef],
           folder: Path) -> tuple[tuple[dict, ...], tuple[ImageRef, ...]]:
    if not isinstance(value, list) or not value:
        raise DataError(source, "schema", f'field "{field}" must be a non-empty list of turns')
    turns, images, unused = [], [], list(named_images)
    for t, turn in enumerate(value):
        where = f"{field}[{t}]"
        if not isinstance(turn, dict) or not isinstance(turn.get("role"), str) or "content" not in turn:
            raise DataError(source, "schema", f'field "{where}": a turn must be {{"role": str, "content": ...}}')
        content = turn["content"]
        if isinstance(content, list):
            content = [_part(source, f"{where}.content[{p}]", part, unused, images, folder)
                       for p, part in enumerate(content)]
        elif not isinstance(content, str):
            raise DataError(source, "schema", f'field "{where}.content": must be a string or a list of parts, '
                            f"got {type(content).__name__}")
        turns.append({"role": turn["role"], "content": content})
    if unused:
        raise DataError(source, "image tokens", f'{len(named_images)} image(s) in "images" but '
                        f"{len(named_images) - len(unused)} image part(s) take one")
    return tuple(turns), tuple(images)


def _part(source: str, field: str, part: Any, unused: list[ImageRef], images: list[ImageRef],
          folder: Path) -> dict[str, Any]:
    """A content part as the chat template takes it; an image part's image appended to `images`."""
    kind = part.get("type") if isinstance(part, dict) else None
    if kind == "text":
        if not isinstance(part.get("text"), str):
            raise DataError(source, "schema", f'field "{field}.text": a text part needs a string')
        return {"type": "text", "text": part["text"]}
    if kind != "image":
        raise DataError(source, "schema", f'field "{field}": a part must be {{"type": "text" | "image", ...}}, '
                        f"got {part!r:.80}")
    inline = next((key for key in ("image", "path") if part.get(key) is not None), None)
    if inline is not None:
        images.append(_image(source, f"{field}.{inline}", part[inline], folder))
    elif unused:
        images.append(unused.pop(0))
    else:
        raise DataError(source, "schema", f'field "{field}": an image part without an image (no "image" or '
                        '"path" in it and none left in "images")')
    return {"type": "image"}


def _column(source: str, record: dict[str, Any], column: str, key: str) -> Any:
    """The value at dotted `column` (data.fields.`key` names it)."""
    value: Any = record
    for depth, name in enumerate(column.split(".")):
        if not isinstance(value, dict) or value.get(name) is None:
            reached = ".".join(column.split(".")[:depth + 1])
            raise DataError(source, "schema", f'missing field "{reached}" (data.fields.{key}: {column})')
        value = value[name]
    return value


def _json_value(source: str, column: str, value: Any) -> Any:
    """`value` if it is JSON-like (it travels to the reward function in handle metadata)."""
    if value is None or isinstance(value, str | bool | int):
        return value
    if isinstance(value, float) and math.isfinite(value):
        return value
    if isinstance(value, list):
        return [_json_value(source, column, item) for item in value]
    if isinstance(value, dict) and all(isinstance(key, str) for key in value):
        return {key: _json_value(source, column, item) for key, item in value.items()}
    raise DataError(source, "schema", f'field "{column}": {type(value).__name__} values cannot reach the reward '
                    "function (strings, numbers, lists and string-keyed maps can)")
