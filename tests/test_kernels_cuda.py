"""The fused log-prob/entropy kernels compiled for a real GPU: values and gradients against the
eager references, at the production tiles and at vocabulary sizes of real models.

tests/test_kernels_logprob.py runs the same kernels through Triton's interpreter on CPU tensors;
this file needs a CUDA device and the compiler, so the interpreter must be off:

    TRITON_INTERPRET=0 .venv/bin/python -m pytest -m gpu tests/test_kernels_cuda.py -q
"""

from __future__ import annotations

import os

import pytest
import torch

from stream_rlhf.kernels import dispatch
from stream_rlhf.kernels.logprob import (
    logprobs_from_hidden,
    logprobs_from_logits,
    reference_logprobs_from_hidden,
    reference_logprobs_from_logits,
)
from tests.test_kernels_logprob import _close, _inputs_hidden, _inputs_logits, _run_hidden, _run_logits

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="compiles the Triton kernels for a CUDA device"),
    pytest.mark.skipif(not dispatch.TRITON_AVAILABLE, reason='triton is not installed: pip install -e ".[kernels]"'),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                       reason="Triton's interpreter is on (tests/conftest.py sets it): run with TRITON_INTERPRET=0"),
]
SHAPES = [(1, 17), (37, 257), (300, 32000), (1024, 152064)]  # (T, V): tiny, ragged, Llama-2, Qwen2


def cuda(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.cuda() for t in tensors]


def test_auto_dispatch_picks_triton_for_cuda_tensors():
    assert dispatch.backend_for(torch.zeros(1, device="cuda")) == "triton"


@pytest.mark.parametrize("T,V", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logits_form_on_cuda(T, V, dtype):
    logits, labels, g_logp, g_ent = cuda(*_inputs_logits(T, V, dtype))
    got = _run_logits(logprobs_from_logits, logits, labels, g_logp, g_ent, 0.7)
    want = _run_logits(reference_logprobs_from_logits, logits.float(), labels, g_logp, g_ent, 0.7)
    assert got[2].dtype == dtype and got[2].is_cuda
    if dtype == torch.float32:
        _close(got, want, atol=1e-4, rtol=1e-4)  # fp32 sums in another order over up to 152k terms
    else:
        _close(got, want, atol=2e-2, rtol=1e-2)  # bf16 grads round at ~0.4% relative


@pytest.mark.parametrize("T,V", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hidden_form_on_cuda(T, V, dtype):
    hidden, weight, labels, g_logp, g_ent = cuda(*_inputs_hidden(T, V, dtype))
    got = _run_hidden(logprobs_from_hidden, hidden, weight, labels, g_logp, g_ent, 0.7)
    want = _run_hidden(reference_logprobs_from_hidden, hidden.float(), weight.float(), labels, g_logp, g_ent, 0.7)
    assert got[2].dtype == got[3].dtype == dtype
    if dtype == torch.float32:
        # fp32 tl.dot runs as IEEE (no TF32), as the reference; sums over 152k terms in another order
        _close(got, want, atol=1e-3, rtol=1e-3)
    else:
        # bf16 tensor-core tiles against an fp32 reference: logits round at ~0.4% relative
        _close(got[:2], want[:2], atol=5e-2, rtol=1e-2)
        _close(got[2:], want[2:], atol=5e-2, rtol=5e-2)
