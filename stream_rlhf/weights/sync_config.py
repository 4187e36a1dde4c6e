"""Config of weight sync (`weights`): how rollout gets each new policy version from actor_train,
beside the transports (`shm_store.py`, `broadcast.py`, `cuda_ipc.py`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

from msgspec import Meta

from stream_rlhf.config import check_fields


@dataclass(frozen=True)
class WeightSyncConfig:
    """How rollout gets each new policy version from actor_train (`stream_rlhf/weights/`)."""

    transport: Literal["shm", "broadcast", "cuda_ipc"] = "shm"
    """`shm`: the version's safetensors file in /dev/shm (one host); `broadcast`: a
    torch.distributed group per rollout instance (gloo on CPU, NCCL on GPUs) sending the weights in
    buckets; `cuda_ipc`: CUDA IPC handles (trainer and rollout on one GPU)."""
    update: Literal["drain", "in_flight"] = "drain"
    """`drain`: between mini-batches; `in_flight` (vLLM): between engine steps, requests keep their
    KV cache and each token records the version that sampled it."""
    bucket_mb: Annotated[int, Meta(ge=1)] = 64
    """`broadcast` / `cuda_ipc`: parameters travel in flat buckets of at most this many MiB."""
    timeout_s: Annotated[float, Meta(gt=0)] = 180.0
    """How long a weight-sync group waits for its ranks to join."""
    publish: Literal["auto", "sync", "background"] = "auto"
    """How a trainer puts out each new version (the store's file, the senders, then actor_train's
    weights_ready): `sync` inside the iteration; `background` after a host snapshot of the weights,
    on a thread of its own while the next iteration trains (a stage waiting for the version waits
    as long as the write takes, as with sync); `auto`: background on a GPU, sync on the CPU, where
    the snapshot copies as many bytes as the write (`stages/weight_publish.py`)."""

    def __post_init__(self) -> None:
        check_fields(self)
