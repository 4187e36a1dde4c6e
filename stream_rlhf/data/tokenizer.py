"""The tokenizer of a checkpoint folder, as the data side uses it: prompts become token ids,
responses become text, and `rollout.stop` becomes the token ids that end a response.

    tokenizer = load_tokenizer(checkpoint)            # the folder's own (a tiny model's is saved there too)
    stop_ids = stop_token_ids(tokenizer, cfg.rollout.stop, cfg.data.chat_template, checkpoint)

Without `rollout.stop` a response ends at the tokenizer's end-of-sequence token, the chat
template's end-of-turn token (`<|im_end|>` for ChatML) and the eos ids of the folder's
generation_config.json (an instruct model's lists its end-of-turn there too).

Building the tiny model's character tokenizer (saved into its folder by the warm start) is
`models/tokenizer.py`'s business.
"""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from stream_rlhf.data.chat_template import NONE, end_of_turn_id, resolve_chat_template
from stream_rlhf.data.generation_config import read_generation_config


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """The tokenizer saved in checkpoint folder `path`; one without a pad token pads with its
    end-of-sequence token."""
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def stop_token_ids(tokenizer: PreTrainedTokenizerBase, stop: list[str] | None, chat_template: str = NONE,
                   folder: str | Path | None = None) -> tuple[int, ...]:
    """Ids of the tokens that end a response: `stop`, or the tokenizer's end-of-sequence token,
    the end-of-turn token of `chat_template` (a `data.chat_template` setting) and the eos ids of
    `folder`'s generation_config.json."""
    if stop is None:
        ids = [tokenizer.eos_token_id, end_of_turn_id(tokenizer, resolve_chat_template(chat_template, tokenizer)),
               *generation_eos_ids(folder)]
        return tuple(dict.fromkeys(i for i in ids if i is not None))
    ids = tuple(tokenizer.convert_tokens_to_ids(token) for token in stop)
    unknown = [token for token, i in zip(stop, ids) if i is None or i == tokenizer.unk_token_id]
    if unknown:
        raise ValueError(f"rollout.stop: {unknown} are not tokens of this tokenizer")
    return ids


def generation_eos_ids(folder: str | Path | None) -> list[int]:
    """`eos_token_id` of `folder`'s generation_config.json (one id or a list); [] without one."""
    eos = read_generation_config(folder).get("eos_token_id")
    return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
