"""Compile the fused log-prob kernels at stage setup, not inside the first training steps.

    added = warm_up_logprob_kernels(engine, trains=True)   # the specialisations it compiled
    added = warm_up_sampling_kernel(model)                 # rollout's: the log-prob of each sampled token

On CUDA each new specialisation of a Triton kernel compiles on its first launch: seconds, which
landed inside actor_train steps (issue 32: 7.8 and 9.7 s steps). The token count no longer
specialises the kernels (`kernels/specialisations.py`), so what a stage's steps launch is known at
setup: the hidden-state forward, and for a trainer its two backward kernels with the gradient of
the log-probs alone (no entropy bonus) and with the entropy's too. This runs them once through the
engine's own forward (same dtype under autocast, same LM head), on one short sequence, and records
it as a "kernel warm-up" span in the trace. A no-op where the kernels would not run Triton (the
CPU, unless forced) or the model has no LM head (a critic). The torch sampler's kernel (the
log-prob of each sampled token from a decode step's fp32 logits) compiled inside rollout's first
mini-batch: 1.2 s of the main job's first iteration on an H200; rollout warms it at setup too.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from stream_rlhf.backends.torch_engine import TorchTrainEngine
from stream_rlhf.kernels.dispatch import backend_for
from stream_rlhf.kernels.logprob import logprobs_from_logits
from stream_rlhf.kernels.specialisations import specialisations
from stream_rlhf.telemetry import trace

WARM_UP_TOKENS = 16
"""Length of the sequence the warm-up runs (the kernels' compiled code does not depend on it)."""


def _plain_tokens(model: torch.nn.Module, count: int) -> torch.Tensor:
    """`count` token ids that are no special token of the model's config (image, video, ...)."""
    special = {v for k, v in vars(model.config).items() if k.endswith("token_id") and isinstance(v, int)}
    return torch.tensor([t for t in range(count + len(special)) if t not in special][:count])


def warm_up_logprob_kernels(engine: TorchTrainEngine, trains: bool) -> int:
    """Launch every kernel variant the engine's steps will launch; returns how many were new."""
    head = _triton_head(engine.model)
    if head is None:
        return 0

    def launch() -> None:
        sequence = _plain_tokens(engine.model, WARM_UP_TOKENS)
        if trains:
            for with_entropy_gradient in (False, True):
                logp, entropy = engine.logprobs([sequence], 1.0, with_entropy=True)
                loss = logp[0].sum() + (entropy[0].sum() if with_entropy_gradient else 0.0)
                loss.backward()
            engine.optimizer.zero_grad()  # nothing of the warm-up reaches a step
        else:
            with torch.inference_mode():
                engine.logprobs([sequence], 1.0)

    return _compiled(launch, trains)


def warm_up_sampling_kernel(model: torch.nn.Module) -> int:
    """Launch the sampler's kernel once, on one row of fp32 logits of the model's width (decode
    steps take `.float()` of the LM head's output); returns how many specialisations were new."""
    head = _triton_head(model)
    if head is None:
        return 0

    def launch() -> None:
        device = head.weight.device
        with torch.inference_mode():
            logprobs_from_logits(torch.zeros(1, head.weight.shape[0], device=device),
                                 torch.zeros(1, dtype=torch.long, device=device))

    return _compiled(launch, trains=False)


def _triton_head(model: torch.nn.Module) -> torch.nn.Module | None:
    """The model's LM head when the log-prob kernels run Triton on it; None otherwise (nothing to warm)."""
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if get_head is not None else None
    return head if head is not None and backend_for(head.weight) == "triton" else None


def _compiled(launch: Callable[[], None], trains: bool) -> int:
    """Run `launch` as a "kernel warm-up" span of the trace; the specialisations it added."""
    before = len(specialisations())
    started = trace.now_ns()
    launch()
    added = len(specialisations()) - before
    trace.complete("kernel warm-up", "compile", started, trace.now_ns(), specialisations=added, trains=trains)
    return added
