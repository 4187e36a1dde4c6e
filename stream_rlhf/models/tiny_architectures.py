"""The Hugging Face models the embedded tiny model is built as, one builder per architecture.

    model = tiny_model(cfg, tokenizer)   # cfg: model.tiny; random weights (seed them first)

`cfg.architecture` picks the family, `cfg.vision` its vision-language member:

    architecture   text (vision None)        vision-language
    qwen2          Qwen2ForCausalLM          Qwen2VLForConditionalGeneration
    qwen3          Qwen3ForCausalLM          Qwen3VLForConditionalGeneration

Qwen3 is Qwen2 without the QKV bias and with an RMSNorm on each head's queries and keys; Qwen3-VL
adds to that interleaved M-RoPE, a learned position grid in the vision tower, and deepstack: the
outputs of some vision blocks, merged like the last one's, are added to the hidden states of the
first decoder layers at the image tokens.

The vocabulary is the project's tokenizer's; a vision-language model needs its image tokens
(`build_tokenizer(vision=True)`).
"""

from __future__ import annotations

from typing import Any

from transformers import (
    PreTrainedModel,
    PreTrainedTokenizerBase,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
)

from stream_rlhf.models.model_config import TinyModelConfig, TinyVisionConfig
from stream_rlhf.models.tokenizer import VISION_TOKENS

QWEN3_VL_POSITION_GRID = 8
"""Side of Qwen3-VL's learned vision position grid (8 x 8 embeddings), resampled to each image's
patch grid: the tiny tower's 32-pixel images are 4 x 4 patches."""
MAX_DEEPSTACK_LEVELS = 3
"""Qwen3-VL's released models take deepstack features after 3 of their vision blocks."""


def tiny_model(cfg: TinyModelConfig, tokenizer: PreTrainedTokenizerBase) -> PreTrainedModel:
    """A random-initialised model of `cfg.architecture` sized by `cfg` (see the table above)."""
    if cfg.vision is not None:
        return _vision_language(cfg, cfg.vision, tokenizer)
    text = {**_text_settings(cfg, tokenizer), "tie_word_embeddings": True}
    if cfg.architecture == "qwen3":
        return Qwen3ForCausalLM(Qwen3Config(**text))
    return Qwen2ForCausalLM(Qwen2Config(**text))


def deepstack_layers(vision: TinyVisionConfig) -> list[int]:
    """The vision blocks whose output a tiny Qwen3-VL feeds to the language model's first layers
    (deepstack): every block but the last, at most `MAX_DEEPSTACK_LEVELS`."""
    return list(range(min(vision.depth - 1, MAX_DEEPSTACK_LEVELS)))


def _special_tokens(tokenizer: PreTrainedTokenizerBase) -> dict[str, int]:
    return {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id}


def _text_settings(cfg: TinyModelConfig, tokenizer: PreTrainedTokenizerBase) -> dict[str, Any]:
    return {
        "vocab_size": len(tokenizer),
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.max_position_embeddings,
        **_special_tokens(tokenizer),
    }


def _vision_language(cfg: TinyModelConfig, vision: TinyVisionConfig,
                     tokenizer: PreTrainedTokenizerBase) -> PreTrainedModel:
    start, image, end = tokenizer.convert_tokens_to_ids(list(VISION_TOKENS))
    if image == tokenizer.unk_token_id:
        raise ValueError("build_tiny: the tokenizer has no image tokens (build it with build_tokenizer(vision=True))")
    # M-RoPE splits each head's rotary frequencies between (time, height, width): 1/4, 3/8, 3/8 as in Qwen2-VL
    half = cfg.head_dim // 2
    quarter = cfg.head_dim // 8
    mrope_section = [quarter, (half - quarter) // 2, half - quarter - (half - quarter) // 2]
    rope = {"rope_type": "default", "mrope_section": mrope_section, "rope_theta": 10000.0}
    tokens = {"image_token_id": image, "vision_start_token_id": start, "vision_end_token_id": end,
              # no video: a token the tokenizer never emits for text
              "video_token_id": tokenizer.unk_token_id, "tie_word_embeddings": True}
    shared_vision = {"depth": vision.depth, "num_heads": vision.num_heads, "patch_size": vision.patch_size,
                     "temporal_patch_size": vision.temporal_patch_size,
                     "spatial_merge_size": vision.spatial_merge_size}
    if cfg.architecture == "qwen3":
        config = Qwen3VLConfig(
            text_config={**_text_settings(cfg, tokenizer), "rope_parameters": {**rope, "mrope_interleaved": True}},
            vision_config={**shared_vision, "hidden_size": vision.embed_dim,
                           "intermediate_size": vision.embed_dim * vision.mlp_ratio, "out_hidden_size": cfg.hidden_size,
                           "num_position_embeddings": QWEN3_VL_POSITION_GRID**2,
                           "deepstack_visual_indexes": deepstack_layers(vision)},
            **tokens,
        )
        return Qwen3VLForConditionalGeneration(config)
    config = Qwen2VLConfig(
        text_config={**_text_settings(cfg, tokenizer), "rope_parameters": rope},
        vision_config={**shared_vision, "embed_dim": vision.embed_dim, "hidden_size": cfg.hidden_size,
                       "mlp_ratio": vision.mlp_ratio},
        **tokens,
        **_special_tokens(tokenizer),
    )
    return Qwen2VLForConditionalGeneration(config)
