"""The character-level tokenizer the project builds itself (no hub access), saved in Hugging Face
format beside the model so a checkpoint folder is self-contained.

    tokenizer = build_tokenizer()                 # PreTrainedTokenizerFast
    tokenizer.save_pretrained(folder)             # loads back with AutoTokenizer.from_pretrained

Every character of `ALPHABET` is one token; `<pad>`, `<bos>` and `<eos>` come first (ids 0, 1, 2).
`build_tokenizer(vision=True)` adds Qwen2-VL's image tokens after the alphabet (`VISION_TOKENS`:
an image is `<|vision_start|>`, one `<|image_pad|>` per image feature, `<|vision_end|>`).
Real checkpoints bring their own tokenizer in their folder and never use this one.
"""

from __future__ import annotations

import string

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")
ALPHABET = string.digits + string.ascii_lowercase + "+-*=?:,. "
VISION_TOKENS = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>")


def build_tokenizer(vision: bool = False) -> PreTrainedTokenizerFast:
    extra = VISION_TOKENS if vision else ()
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + tuple(ALPHABET) + extra)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.add_special_tokens(list(extra))  # matched whole, before the split into characters
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>", unk_token="<unk>"
    )
