"""A conversation to prompt ids: through the tokenizer's chat template (`data.chat_template`), or
as written when there is none, with one image placeholder per image for the dataset to widen.

    template = resolve_chat_template("auto", tokenizer)    # the tokenizer's, None when it has none
    ids = conversation_ids(tokenizer, template, turns, vision_token_ids)   # list[int]
    prompt = expand_image_pads(ids, image_pad_id, [64, 16]) # (L,) long: each pad widened to its tokens

With a template the ids are `tokenizer.apply_chat_template(turns, add_generation_prompt=True)`'s:
the template renders each image part (Qwen2-VL's and Qwen3-VL's write `<|vision_start|><|image_pad|>
<|vision_end|>`) and each image's pad is then repeated once per image token, as transformers'
processors do. Without one, a conversation must be a single user turn; its text goes to the model
as written after a bos (where the tokenizer has one), each image as vision_start, image_pad,
vision_end (`encode_prompt`).

`end_of_turn_id` finds the token a template closes an assistant turn with (`<|im_end|>` for
ChatML), which rollout adds to its stop tokens.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from jinja2 import TemplateError
from transformers import PreTrainedTokenizerBase

from stream_rlhf.data.conversation import IMAGE_MARKER

log = logging.getLogger("stream_rlhf")
NONE, AUTO = "none", "auto"


class ConversationError(ValueError):
    """A conversation the chat template (or its absence) cannot encode; other ValueErrors of this
    module are images that do not match their places."""


def resolve_chat_template(setting: str, tokenizer: PreTrainedTokenizerBase) -> str | None:
    """The Jinja template `data.chat_template` names: none (None), auto (the tokenizer's, None
    when it has none) or a file's text."""
    if setting == NONE:
        return None
    if setting == AUTO:
        template = tokenizer.chat_template
        if isinstance(template, dict):  # named templates: the default one
            template = template.get("default")
        return template or None
    return Path(setting).read_text()


def conversation_ids(tokenizer: PreTrainedTokenizerBase, template: str | None, turns: tuple[dict[str, Any], ...],
                     vision_token_ids: tuple[int, int, int] | None, tools: list[dict[str, Any]] | None = None
                     ) -> list[int]:
    """The prompt ids of `turns`, one image pad per image part (ValueError for a conversation
    the setting cannot encode, or a template that drops or adds image pads); `tools`: JSON
    schemas the template writes into the prompt (`env.tools`; needs a template)."""
    images = sum(1 for turn in turns for part in _parts(turn) if part["type"] == "image")
    if images and vision_token_ids is None:
        raise ValueError("prompt has images but the model takes none (no vision tower)")
    if template is None:
        if len(turns) != 1 or turns[0]["role"] != "user":
            raise ConversationError(f"a conversation of {len(turns)} turn(s) ({', '.join(t['role'] for t in turns)}) "
                             "needs a chat template (data.chat_template; the tokenizer has none)")
        return encode_prompt(tokenizer, conversation_text(turns), [1] * images, vision_token_ids).tolist()
    try:
        text = tokenizer.apply_chat_template(list(turns), chat_template=template, add_generation_prompt=True,
                                             tokenize=False, tools=tools)
    except TemplateError as error:
        raise ConversationError(f"the chat template cannot render this conversation ({error})") from None
    ids = tokenizer.encode(text, add_special_tokens=False)
    pads = 0 if vision_token_ids is None else ids.count(vision_token_ids[1])
    if pads != images:
        raise ValueError(f"the chat template wrote {pads} image placeholder(s) for {images} image part(s) "
                         "(a template of a vision-language model writes one per image part)")
    return ids


def encode_prompt(
    tokenizer: PreTrainedTokenizerBase,
    text: str,
    image_token_counts: list[int],
    vision_token_ids: tuple[int, int, int] | None,
) -> torch.Tensor:
    """(L,) long ids: bos (if the tokenizer has one), then `encode_with_images` of the text.

    `vision_token_ids` is (vision_start, image_pad, vision_end), e.g. a Qwen2-VL config's
    (vision_start_token_id, image_token_id, vision_end_token_id); None for a text-only model (then no
    markers). Raises ValueError when the markers and counts differ in number, a count is < 1, or the
    text itself encodes to a vision token."""
    ids = [] if tokenizer.bos_token_id is None else [tokenizer.bos_token_id]
    return torch.tensor(ids + encode_with_images(tokenizer, text, image_token_counts, vision_token_ids, "prompt"),
                        dtype=torch.long)


def encode_with_images(
    tokenizer: PreTrainedTokenizerBase,
    text: str,
    image_token_counts: list[int],
    vision_token_ids: tuple[int, int, int] | None,
    what: str,
) -> list[int]:
    """The ids of `text` with each <image> marker replaced by vision_start, image_pad * n,
    vision_end (n = the next of `image_token_counts`); no bos (a prompt's or an observation's
    text, `what` in messages; `encode_prompt` says what raises)."""
    segments = text.split(IMAGE_MARKER)
    if len(segments) - 1 != len(image_token_counts):
        raise ValueError(f"{what} has {len(segments) - 1} {IMAGE_MARKER} markers "
                         f"for {len(image_token_counts)} image(s)")
    if vision_token_ids is None and image_token_counts:
        raise ValueError(f"{what} has images but the model takes none (no vision tower)")
    start, pad, end = vision_token_ids or (None, None, None)
    ids: list[int] = []
    for i, segment in enumerate(segments):
        if i > 0:
            count = image_token_counts[i - 1]
            if count < 1:
                raise ValueError(f"image {i} has {count} image tokens, expected >= 1")
            ids += [start] + [pad] * count + [end]
        segment_ids = tokenizer.encode(segment, add_special_tokens=False) if segment else []
        if vision_token_ids is not None and set(segment_ids) & {start, pad, end}:
            raise ValueError(f"{what} text contains a vision special token (write images as <image> markers)")
        ids += segment_ids
    return ids


def expand_image_pads(ids: list[int], image_pad_id: int | None, token_counts: list[int]) -> torch.Tensor:
    """(L,) long: `ids` with its i-th image pad repeated token_counts[i] times."""
    out: list[int] = []
    counts = iter(token_counts)
    for token in ids:
        out += [token] * next(counts) if token == image_pad_id else [token]
    return torch.tensor(out, dtype=torch.long)


def writes_tools(tokenizer: PreTrainedTokenizerBase, template: str, tools: list[dict[str, Any]]) -> bool:
    """Whether `template` writes anything of `tools` into a prompt (one that ignores them does not)."""
    turns = [{"role": "user", "content": "hi"}]
    def render(with_tools: list[dict[str, Any]] | None) -> str:
        return tokenizer.apply_chat_template(turns, chat_template=template, add_generation_prompt=True,
                                             tokenize=False, tools=with_tools)
    return render(tools) != render(None)


def end_of_turn_id(tokenizer: PreTrainedTokenizerBase, template: str | None) -> int | None:
    """The special token `template` writes right after an assistant turn's text, or None (no
    template, or it ends turns with plain text)."""
    if template is None:
        return None
    marker = "stop here"
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": marker}]
    try:
        text = tokenizer.apply_chat_template(turns, chat_template=template, tokenize=False)
    except TemplateError as error:  # a template for prompts only: responses end at the other stop tokens
        log.warning("the chat template cannot write an assistant turn (%s): rollout does not stop at an "
                    "end-of-turn token; set rollout.stop to name one", error)
        return None
    after = text[text.rfind(marker) + len(marker):]
    ids = tokenizer.encode(after, add_special_tokens=False)
    return ids[0] if ids and ids[0] in tokenizer.all_special_ids + _added_special_ids(tokenizer) else None


def _added_special_ids(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    return [i for i, token in tokenizer.added_tokens_decoder.items() if token.special]


def conversation_text(turns: tuple[dict[str, Any], ...]) -> str:
    """The turns' contents, one turn a line, each image part an <image> marker (a readable prompt:
    today's form gets its prompt back)."""
    return "\n".join("".join(part["text"] if part["type"] == "text" else IMAGE_MARKER for part in _parts(turn))
                     for turn in turns)


def turn_texts(turns: tuple[dict[str, Any], ...]) -> list[str]:
    """The text of every text part of `turns`."""
    return [part["text"] for turn in turns for part in _parts(turn) if part["type"] == "text"]


def _parts(turn: dict[str, Any]) -> list[dict[str, Any]]:
    content = turn["content"]
    return [{"type": "text", "text": content}] if isinstance(content, str) else content
