"""Llama (LlamaForCausalLM; the critic's LlamaForTokenClassification): no biases
(`attention_bias` and `mlp_bias` must be false: `model.py` refuses them)."""

from stream_rlhf.backends.megatron.weights import Architecture

LLAMA = Architecture(name="llama", qkv_bias=False)
