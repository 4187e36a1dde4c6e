"""The compute precision of the torch engines and the torch sampler: `precision` in the job config.

    with autocast(device, "bf16"):
        logits = model(...)

auto    bf16 on a CUDA device, fp32 elsewhere (the default): `resolve_precision`.
fp32    every forward and backward in float32 (the CPU's default).
bf16    mixed precision: forward passes run under `torch.autocast` with bfloat16 (matmuls in bf16;
        norms, softmax and reductions as autocast keeps them), while weights, gradients and the
        optimizer state stay fp32 and the log-probs and entropies of the LM head are computed in
        fp32 (`kernels/logprob.py` runs outside autocast). On GPUs and on CPUs with AMX or
        AVX512-BF16 bf16 matmuls run several times faster: a 12M-parameter model's training step
        (64 samples of 54 tokens) took 1.14 s instead of 3.24 s on one Xeon core with AMX. The
        cost is bf16 rounding in every matmul: the same step's log-probs moved by 0.016 on average.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Literal

import torch

Precision = Literal["auto", "fp32", "bf16"]


def resolve_precision(precision: Precision, device: torch.device) -> Literal["fp32", "bf16"]:
    """`auto` -> bf16 on CUDA (tensor cores), fp32 on the CPU; fp32 and bf16 as asked."""
    if precision == "auto":
        return "bf16" if device.type == "cuda" else "fp32"
    return precision


def autocast(device: torch.device, precision: Precision) -> AbstractContextManager:
    """Mixed precision on `device` where `precision` resolves to bf16; a context that changes nothing for fp32."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=resolve_precision(precision, device) == "bf16")
