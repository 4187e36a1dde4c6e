"""The tiny Qwen2, Qwen3 and Qwen2.5-VL models the tests build (no hub: from config objects)."""

from __future__ import annotations

from typing import Any

import torch
from transformers import (
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2ForTokenClassification,
    Qwen3Config,
)

from stream_rlhf.models.tokenizer import VISION_TOKENS, build_tokenizer


def _tiny_text_settings(vocab_size: int) -> dict[str, Any]:
    return {
        "vocab_size": vocab_size, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32, "max_position_embeddings": 128,
        "tie_word_embeddings": True,
    }


def tiny_qwen2_config(vocab_size: int, **extra: Any) -> Qwen2Config:
    """2 layers, hidden 64, head_dim 32 (the smallest vLLM serves); `extra` adds or overrides keys."""
    return Qwen2Config(**{**_tiny_text_settings(vocab_size), **extra})


def tiny_qwen3_config(vocab_size: int, **extra: Any) -> Qwen3Config:
    """`tiny_qwen2_config`'s sizes as a Qwen3 (no QKV bias, per-head query and key norms)."""
    return Qwen3Config(**{**_tiny_text_settings(vocab_size), **extra})


def seeded_qwen2_policy(vocab_size: int) -> Qwen2ForCausalLM:
    """A `tiny_qwen2_config` causal LM, the same weights at every call (seed 0)."""
    torch.manual_seed(0)
    return Qwen2ForCausalLM(tiny_qwen2_config(vocab_size))


def seeded_qwen2_critic(vocab_size: int) -> Qwen2ForTokenClassification:
    """Its critic: a scalar head per token, no dropout before it (as `load_critic` builds one)."""
    torch.manual_seed(0)
    critic = Qwen2ForTokenClassification(tiny_qwen2_config(vocab_size, num_labels=1))
    critic.dropout.p = 0.0
    return critic


def tiny_qwen2_5_vl() -> Qwen2_5_VLForConditionalGeneration:
    """A valid tiny Qwen2.5-VL for the project's tokenizer with image tokens (patch 8, merge 2):
    32-pixel attention windows (2 x 2 merged tokens), full attention in block 1."""
    tokenizer = build_tokenizer(vision=True)
    start, image, end = tokenizer.convert_tokens_to_ids(list(VISION_TOKENS))
    special = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
               "pad_token_id": tokenizer.pad_token_id}
    config = Qwen2_5_VLConfig(
        text_config={
            "vocab_size": len(tokenizer), "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32, "max_position_embeddings": 128,
            "rope_parameters": {"rope_type": "default", "mrope_section": [4, 6, 6], "rope_theta": 10000.0},
            **special,
        },
        vision_config={
            "depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64,
            "patch_size": 8, "temporal_patch_size": 2, "spatial_merge_size": 2, "window_size": 32,
            "fullatt_block_indexes": [1],
        },
        image_token_id=image,
        vision_start_token_id=start,
        vision_end_token_id=end,
        video_token_id=tokenizer.unk_token_id,
        tie_word_embeddings=True,
        **special,
    )
    torch.manual_seed(0)
    return Qwen2_5_VLForConditionalGeneration(config)
