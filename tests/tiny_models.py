"""The tiny Qwen2-architecture config the model-level tests build their models from."""

from __future__ import annotations

from typing import Any

from transformers import Qwen2Config


def tiny_qwen2_config(vocab_size: int, **extra: Any) -> Qwen2Config:
    """2 layers, hidden 64, head_dim 32 (the smallest vLLM serves); `extra` adds or overrides keys."""
    settings: dict[str, Any] = {
        "vocab_size": vocab_size, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32, "max_position_embeddings": 128,
        "tie_word_embeddings": True,
    }
    return Qwen2Config(**{**settings, **extra})
