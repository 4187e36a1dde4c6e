"""The tokenizer of a checkpoint folder, as the data side uses it: prompts become token ids,
responses become text, and `rollout.stop` becomes the token ids that end a response.

    tokenizer = load_tokenizer(checkpoint)            # the folder's own (a tiny model's is saved there too)
    stop_ids = stop_token_ids(tokenizer, cfg.rollout.stop)

Building the tiny model's character tokenizer (saved into its folder by the warm start) is
`models/tokenizer.py`'s business.
"""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """The tokenizer saved in checkpoint folder `path`; one without a pad token pads with its
    end-of-sequence token."""
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def stop_token_ids(tokenizer: PreTrainedTokenizerBase, stop: list[str] | None) -> tuple[int, ...]:
    """Ids of the tokens that end a response: `stop`, or the tokenizer's end-of-sequence token."""
    if stop is None:
        return (tokenizer.eos_token_id,)
    ids = tuple(tokenizer.convert_tokens_to_ids(token) for token in stop)
    unknown = [token for token, i in zip(stop, ids) if i is None or i == tokenizer.unk_token_id]
    if unknown:
        raise ValueError(f"rollout.stop: {unknown} are not tokens of this tokenizer")
    return ids
