"""Qwen2-VL and Qwen2.5-VL's language model (Qwen2VLForConditionalGeneration,
Qwen2_5_VLForConditionalGeneration): Qwen2's layers under `model.language_model`, M-RoPE positions
(`model.py`), the image features put in at the image tokens by the engine. The vision tower
(`model.visual`) stays out of megatron: frozen, its weights are kept as they are and exported beside
the language model's. The VLM's critic (`models/vision_language.py`, `VisionLanguageCritic`) holds
the same language model as `language_model` (no vision tower) and its value head as `score`."""

from stream_rlhf.backends.megatron.weights import Architecture

QWEN2_VL = Architecture(name="qwen2_vl", qkv_bias=True, layer_prefix="model.language_model.layers",
                        embed="model.language_model.embed_tokens.weight",
                        final_norm="model.language_model.norm.weight")
VISION_PREFIX = "model.visual."
"""The frozen vision tower's weights: never in megatron."""
QWEN2_VL_CRITIC = Architecture(name="qwen2_vl_critic", qkv_bias=True, layer_prefix="language_model.layers",
                               embed="language_model.embed_tokens.weight", final_norm="language_model.norm.weight")
