"""The config of the vLLM rollout engine (`rollout.vllm`), beside the engine (`vllm_rollout_engine.py`,
`backends/vllm_client.py`)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from stream_rlhf.config import ConfigError


@dataclass(frozen=True)
class VllmConfig:
    """The vLLM engine of each rollout instance (`rollout.backend: vllm`), a process of its own."""

    python: str | None = None
    """The Python that runs the engine process; None: this one. vLLM pins its own torch and
    transformers, so it may live in an environment of its own (`scripts/setup_vllm_cpu.sh` makes
    `.venv-vllm` on CPU machines)."""
    max_model_len: int | None = None
    """Prompt + response tokens per sequence; None: the model's max_position_embeddings."""
    start_timeout_s: float = 600.0
    kv_cache_gb: float = 1.0
    """CPU: KV cache size in GiB (whole GiB, at least 1)."""
    gpu_memory_utilization: float = 0.5
    """CUDA: the fraction of the device vLLM may take; the rest is left to colocated training."""
    tensor_parallel_size: int = 1
    enforce_eager: bool = True
    """No CUDA graphs or torch.compile: the engine starts in seconds instead of tens of seconds."""
    max_num_seqs: int = 256
    """Sequences decoded together by continuous batching."""
    sleep: bool = False
    """Release the KV cache and offload the weights after each iteration's last mini-batch and wake
    (weights, then KV cache) for the next: for colocated CUDA placements. A no-op on CPU."""

    def __post_init__(self) -> None:
        if self.kv_cache_gb <= 0:
            raise ConfigError(f"kv_cache_gb={self.kv_cache_gb}: must be > 0")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(f"gpu_memory_utilization={self.gpu_memory_utilization}: must be in (0, 1]")
        if self.python is not None and not os.access(self.python, os.X_OK):
            raise ConfigError(f"python={self.python!r}: not an executable file (make .venv-vllm with "
                              "scripts/setup_vllm_cpu.sh, or point it at a Python with vllm installed)")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ConfigError(f"max_model_len={self.max_model_len}: must be >= 2")
        if self.start_timeout_s <= 0:
            raise ConfigError(f"start_timeout_s={self.start_timeout_s}: must be > 0")
        if self.tensor_parallel_size < 1 or self.max_num_seqs < 1:
            raise ConfigError(f"tensor_parallel_size={self.tensor_parallel_size}, max_num_seqs={self.max_num_seqs}: "
                              "must be >= 1")
