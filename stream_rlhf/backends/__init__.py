"""Rollout and training backends (torch today; vLLM and megatron-core behind the same calls)."""
