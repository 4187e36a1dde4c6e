"""Qwen3 (Qwen3ForCausalLM; the critic's Qwen3ForTokenClassification): Qwen2 without the q, k and v
biases, with an RMSNorm over each attention head's queries and keys (megatron's qk_layernorm)."""

from stream_rlhf.backends.megatron.weights import Architecture

QWEN3 = Architecture(name="qwen3", qkv_bias=False, qk_norm=True)
