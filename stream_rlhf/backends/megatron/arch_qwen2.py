"""Qwen2 (Qwen2ForCausalLM; the critic's Qwen2ForTokenClassification): biases on q, k and v only."""

from stream_rlhf.backends.megatron.weights import Architecture

QWEN2 = Architecture(name="qwen2", qkv_bias=True)
