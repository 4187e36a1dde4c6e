"""The character-level tokenizer the project builds itself (no hub access), saved in Hugging Face
format beside the model so a checkpoint folder is self-contained.

    tokenizer = build_tokenizer()                 # PreTrainedTokenizerFast
    tokenizer.save_pretrained(folder)             # loads back with AutoTokenizer.from_pretrained

Every character of `ALPHABET` is one token; `<pad>`, `<bos>` and `<eos>` come first (ids 0, 1, 2).
Real checkpoints bring their own tokenizer in their folder and never use this one.
"""

from __future__ import annotations

import string

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")
ALPHABET = string.digits + string.ascii_lowercase + "+-*=?:,. "


def build_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + tuple(ALPHABET))}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>", unk_token="<unk>"
    )
