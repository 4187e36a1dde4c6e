"""Fused kernels behind plain PyTorch signatures, with eager references beside them.

Entry points (differentiable; fp32 outputs):
    logprobs_from_logits(logits, labels, temperature=1.0, with_entropy=False)  # (..., V) -> (logp, ent|None)
    logprobs_from_hidden(hidden, weight, labels, temperature=1.0, with_entropy=False, chunk_size=4096)
    reference_logprobs_from_logits(...), reference_logprobs_from_hidden(...)   # naive eager versions

Backend choice (`dispatch`): Triton on CUDA when triton imports, else torch; `force_backend` and
env `STREAM_RLHF_KERNELS=auto|triton|torch` override it. The Triton kernels live in
`stream_rlhf/kernels/triton_logprob.py`.
"""

from stream_rlhf.kernels.dispatch import backend_for, force_backend
from stream_rlhf.kernels.logprob import (
    logprobs_from_hidden,
    logprobs_from_logits,
    reference_logprobs_from_hidden,
    reference_logprobs_from_logits,
)

__all__ = [
    "backend_for",
    "force_backend",
    "logprobs_from_hidden",
    "logprobs_from_logits",
    "reference_logprobs_from_hidden",
    "reference_logprobs_from_logits",
]
