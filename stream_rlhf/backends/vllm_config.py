"""The config of the vLLM rollout engine (`rollout.vllm`), beside the engine (`vllm_rollout_engine.py`,
`backends/vllm_client.py`)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Annotated

from msgspec import Meta

from stream_rlhf.config import ConfigError, check_fields


@dataclass(frozen=True)
class VllmConfig:
    """The vLLM engine of each rollout instance (`rollout.backend: vllm`), a process of its own."""

    python: str | None = None
    """The Python that runs the engine process; None: this one. vLLM pins its own torch and
    transformers, so it may live in an environment of its own (`scripts/setup_vllm_cpu.sh` makes
    `.venv-vllm` on CPU machines)."""
    max_model_len: Annotated[int, Meta(ge=2)] | None = None
    """Prompt + response tokens per sequence; None: the model's max_position_embeddings."""
    start_timeout_s: Annotated[float, Meta(gt=0)] = 600.0
    """How long a rollout instance waits for its engine process to load the model and report ready
    before it fails."""
    kv_cache_gb: Annotated[float, Meta(gt=0)] = 1.0
    """CPU: KV cache size in GiB (whole GiB, at least 1)."""
    gpu_memory_utilization: Annotated[float, Meta(gt=0, le=1)] = 0.5
    """CUDA: the fraction of the device vLLM may take; the rest is left to colocated training."""
    tensor_parallel_size: Annotated[int, Meta(ge=1)] = 1
    """GPUs one engine shards the model over (vLLM's tensor parallelism); weight sync then sends to
    each of them."""
    enforce_eager: bool = True
    """No CUDA graphs or torch.compile: the engine starts in seconds instead of tens of seconds."""
    max_num_seqs: Annotated[int, Meta(ge=1)] = 256
    """Sequences decoded together by continuous batching."""
    block_size: Annotated[int, Meta(ge=1)] | None = None
    """KV cache block size in tokens; None: vLLM's (16 on CUDA, 128 on CPU, where it must be a
    multiple of 32). The prefix cache reuses whole blocks only, so a multi-turn episode's later
    turns find its earlier context cached only in full blocks: smaller blocks help short episodes."""
    sleep: bool = False
    """Release the KV cache and offload the weights after each iteration's last mini-batch and wake
    (weights, then KV cache) for the next: for colocated CUDA placements. A no-op on CPU."""

    def __post_init__(self) -> None:
        check_fields(self)
        if self.python is not None and not os.access(self.python, os.X_OK):
            raise ConfigError(f"python={self.python!r}: not an executable file (make .venv-vllm with "
                              "scripts/setup_vllm_cpu.sh, or point it at a Python with vllm installed)")
