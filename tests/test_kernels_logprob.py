"""Fused log-prob/entropy kernels vs the eager references: values and gradients, fp32 and bf16.

The Triton cases run on CPU tensors through the interpreter (`TRITON_INTERPRET=1`, set in
conftest.py), with small tiles so that every online-LSE loop takes several chunks.

    .venv/bin/python -m pytest tests/test_kernels_logprob.py -q
"""

from __future__ import annotations

import pytest
import torch

from stream_rlhf.kernels import dispatch, logprob
from stream_rlhf.kernels.logprob import (
    logprobs_from_hidden,
    logprobs_from_logits,
    reference_logprobs_from_hidden,
    reference_logprobs_from_logits,
)

needs_triton = pytest.mark.skipif(
    not dispatch.TRITON_AVAILABLE, reason='triton is not installed: pip install -e ".[kernels]" runs these'
)

SHAPES = [(1, 17), (5, 100), (37, 257)]  # (T, V); none a multiple of the 32-wide tile
H = 32


@pytest.fixture
def backend(monkeypatch):
    """Force a backend for one test, with small Triton tiles; restores auto afterwards."""
    monkeypatch.setattr(logprob, "TRITON_LOGITS_BLOCK_V", 32)
    monkeypatch.setattr(logprob, "TRITON_HIDDEN_BLOCKS", (16, 32, 16))
    previous = dispatch.force_backend(None)
    yield dispatch.force_backend
    dispatch.force_backend(previous)


def _inputs_logits(T: int, V: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(T, V, generator=g)).to(dtype)  # (T, V)
    labels = torch.randint(0, V, (T,), generator=g)  # (T,)
    g_logp, g_ent = torch.randn(T, generator=g), torch.randn(T, generator=g)
    return logits, labels, g_logp, g_ent


def _inputs_hidden(T: int, V: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, H, generator=g).to(dtype)  # (T, H)
    weight = (torch.randn(V, H, generator=g) / H**0.25).to(dtype)  # (V, H)
    labels = torch.randint(0, V, (T,), generator=g)
    g_logp, g_ent = torch.randn(T, generator=g), torch.randn(T, generator=g)
    return hidden, weight, labels, g_logp, g_ent


def _run_logits(fn, logits, labels, g_logp, g_ent, temperature):
    x = logits.detach().clone().requires_grad_(True)
    logp, ent = fn(x, labels, temperature, with_entropy=True)
    (logp * g_logp + ent * g_ent).sum().backward()
    return logp.detach(), ent.detach(), x.grad


def _run_hidden(fn, hidden, weight, labels, g_logp, g_ent, temperature, **kw):
    h = hidden.detach().clone().requires_grad_(True)
    w = weight.detach().clone().requires_grad_(True)
    logp, ent = fn(h, w, labels, temperature, with_entropy=True, **kw)
    (logp * g_logp + ent * g_ent).sum().backward()
    return logp.detach(), ent.detach(), h.grad, w.grad


def _close(got, want, atol, rtol=0.0):
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a.float(), b.float(), atol=atol, rtol=rtol)


# --- the references themselves -----------------------------------------------------------------


def test_reference_temperature_semantics():
    """temperature <= 0 (greedy decoding) means the untempered distribution; outputs are fp32."""
    logits, labels, _, _ = _inputs_logits(5, 100, torch.float32)
    untempered = torch.log_softmax(logits, -1).gather(-1, labels[:, None]).squeeze(-1)
    torch.testing.assert_close(reference_logprobs_from_logits(logits, labels, 0.0)[0], untempered)
    _, hot = reference_logprobs_from_logits(logits, labels, 10.0, with_entropy=True)
    _, cold = reference_logprobs_from_logits(logits, labels, 0.5, with_entropy=True)
    assert (hot > cold).all()
    assert reference_logprobs_from_logits(logits.half(), labels, 2.0)[0].dtype == torch.float32


def test_entropy_gradient_formula_matches_autograd():
    """dH/dz_v = -p_v (z_v - sum_u p_u z_u), the formula both kernels use."""
    z = torch.randn(4, 19, dtype=torch.float64, requires_grad=True)
    _, ent = reference_logprobs_from_logits(z.double(), torch.zeros(4, dtype=torch.long), with_entropy=True)
    (grad,) = torch.autograd.grad(ent.sum(), z)
    p = torch.softmax(z.detach(), -1)
    torch.testing.assert_close(grad, -p * (z.detach() - (p * z.detach()).sum(-1, keepdim=True)))


# --- Triton kernels vs references ---------------------------------------------------------------


@needs_triton
@pytest.mark.parametrize("T,V", SHAPES)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_triton_logits_fp32(backend, T, V, temperature):
    backend("triton")
    logits, labels, g_logp, g_ent = _inputs_logits(T, V, torch.float32)
    got = _run_logits(logprobs_from_logits, logits, labels, g_logp, g_ent, temperature)
    want = _run_logits(reference_logprobs_from_logits, logits, labels, g_logp, g_ent, temperature)
    _close(got, want, atol=1e-5, rtol=1e-5)
    assert got[2].dtype == torch.float32


@needs_triton
@pytest.mark.parametrize("T,V", [(5, 100), (37, 257)])
def test_triton_logits_bf16(backend, T, V):
    backend("triton")
    logits, labels, g_logp, g_ent = _inputs_logits(T, V, torch.bfloat16)
    got = _run_logits(logprobs_from_logits, logits, labels, g_logp, g_ent, 0.7)
    want = _run_logits(reference_logprobs_from_logits, logits.float(), labels, g_logp, g_ent, 0.7)
    assert got[0].dtype == got[1].dtype == torch.float32 and got[2].dtype == torch.bfloat16
    _close(got, want, atol=2e-2, rtol=1e-2)  # bf16 grads round at ~0.4% relative


@needs_triton
@pytest.mark.parametrize("T,V", SHAPES)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_triton_hidden_fp32(backend, T, V, temperature):
    backend("triton")
    hidden, weight, labels, g_logp, g_ent = _inputs_hidden(T, V, torch.float32)
    got = _run_hidden(logprobs_from_hidden, hidden, weight, labels, g_logp, g_ent, temperature)
    want = _run_hidden(reference_logprobs_from_hidden, hidden, weight, labels, g_logp, g_ent, temperature)
    _close(got, want, atol=1e-5, rtol=1e-5)


@needs_triton
def test_triton_hidden_bf16(backend):
    backend("triton")
    hidden, weight, labels, g_logp, g_ent = _inputs_hidden(37, 257, torch.bfloat16)
    got = _run_hidden(logprobs_from_hidden, hidden, weight, labels, g_logp, g_ent, 0.7)
    want = _run_hidden(reference_logprobs_from_hidden, hidden.float(), weight.float(), labels, g_logp, g_ent, 0.7)
    assert got[2].dtype == got[3].dtype == torch.bfloat16
    _close(got, want, atol=2e-2, rtol=1e-2)  # bf16 grads round at ~0.4% relative


@needs_triton
def test_triton_logp_only_and_leading_dims(backend):
    """No entropy asked for (its gradient is None); (B, S, V) inputs flatten and come back (B, S)."""
    backend("triton")
    logits, labels, g_logp, _ = _inputs_logits(6, 100, torch.float32)
    x = logits.view(2, 3, 100).requires_grad_(True)
    logp, ent = logprobs_from_logits(x, labels.view(2, 3))
    assert ent is None and logp.shape == (2, 3)
    (logp.reshape(-1) * g_logp).sum().backward()
    y = logits.detach().clone().requires_grad_(True)
    want, _ = reference_logprobs_from_logits(y, labels)
    (want * g_logp).sum().backward()
    torch.testing.assert_close(logp.detach().reshape(-1), want.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(x.grad.reshape(6, 100), y.grad, atol=1e-5, rtol=1e-5)


@needs_triton
def test_triton_hidden_weight_frozen(backend):
    """Only hidden needs a gradient: the dweight kernel is skipped."""
    backend("triton")
    hidden, weight, labels, g_logp, _ = _inputs_hidden(5, 100, torch.float32)
    h = hidden.clone().requires_grad_(True)
    logp, _ = logprobs_from_hidden(h, weight, labels)
    (logp * g_logp).sum().backward()
    h_ref = hidden.clone().requires_grad_(True)
    want, _ = reference_logprobs_from_hidden(h_ref, weight, labels)
    (want * g_logp).sum().backward()
    torch.testing.assert_close(h.grad, h_ref.grad, atol=1e-5, rtol=1e-5)


# --- torch chunked path vs reference ------------------------------------------------------------


@pytest.mark.parametrize("T,V", SHAPES)
@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
def test_torch_chunked_hidden_fp32(backend, T, V, temperature):
    backend("torch")
    hidden, weight, labels, g_logp, g_ent = _inputs_hidden(T, V, torch.float32)
    got = _run_hidden(logprobs_from_hidden, hidden, weight, labels, g_logp, g_ent, temperature, chunk_size=32)
    want = _run_hidden(reference_logprobs_from_hidden, hidden, weight, labels, g_logp, g_ent, temperature)
    _close(got, want, atol=1e-5, rtol=1e-5)


def test_torch_chunked_hidden_bf16(backend):
    backend("torch")
    hidden, weight, labels, g_logp, g_ent = _inputs_hidden(37, 257, torch.bfloat16)
    got = _run_hidden(logprobs_from_hidden, hidden, weight, labels, g_logp, g_ent, 0.7, chunk_size=64)
    want = _run_hidden(reference_logprobs_from_hidden, hidden.float(), weight.float(), labels, g_logp, g_ent, 0.7)
    assert got[2].dtype == got[3].dtype == torch.bfloat16
    _close(got, want, atol=2e-2, rtol=1e-2)  # bf16 grads round at ~0.4% relative


@pytest.mark.parametrize("T,V", SHAPES)
@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
def test_torch_chunked_logits_fp32(backend, monkeypatch, T, V, temperature):
    """Slices of 2 rows (monkeypatched budget), so several slices and a ragged last one."""
    backend("torch")
    monkeypatch.setattr(logprob, "TORCH_CHUNK_ELEMENTS", 2 * V)
    logits, labels, g_logp, g_ent = _inputs_logits(T, V, torch.float32)
    got = _run_logits(logprobs_from_logits, logits, labels, g_logp, g_ent, temperature)
    want = _run_logits(reference_logprobs_from_logits, logits, labels, g_logp, g_ent, temperature)
    _close(got, want, atol=1e-5, rtol=1e-5)


def test_torch_chunked_logits_bf16(backend, monkeypatch):
    backend("torch")
    monkeypatch.setattr(logprob, "TORCH_CHUNK_ELEMENTS", 3 * 257)
    logits, labels, g_logp, g_ent = _inputs_logits(37, 257, torch.bfloat16)
    got = _run_logits(logprobs_from_logits, logits, labels, g_logp, g_ent, 0.7)
    want = _run_logits(reference_logprobs_from_logits, logits.float(), labels, g_logp, g_ent, 0.7)
    assert got[2].dtype == torch.bfloat16
    _close(got, want, atol=2e-2, rtol=1e-2)


# --- dispatch -----------------------------------------------------------------------------------


def test_force_torch_never_calls_triton(backend, monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("triton path called")

    monkeypatch.setattr(logprob._TritonLogits, "apply", boom)
    monkeypatch.setattr(logprob._TritonHidden, "apply", boom)
    backend("torch")
    logits, labels, _, _ = _inputs_logits(5, 100, torch.float32)
    hidden, weight, hlabels, _, _ = _inputs_hidden(5, 100, torch.float32)
    logprobs_from_logits(logits, labels)
    logprobs_from_hidden(hidden, weight, hlabels)
    assert dispatch.backend_for(logits) == "torch"


def test_backend_for_auto_and_forced(backend):
    cpu = torch.zeros(1)
    assert dispatch.backend_for(cpu) == (dispatch._ENV_BACKEND or "torch")
    assert backend("torch") is None
    assert dispatch.backend_for(cpu) == "torch"
    assert backend(None) == "torch"
    with pytest.raises(ValueError, match="backend='cuda'"):
        backend("cuda")  # type: ignore[arg-type]


def test_backend_auto_on_cpu_is_torch(backend, monkeypatch):
    monkeypatch.setattr(dispatch, "_ENV_BACKEND", None)
    assert dispatch.backend_for(torch.zeros(1)) == "torch"
    monkeypatch.setattr(dispatch, "_ENV_BACKEND", "triton")
    monkeypatch.setattr(dispatch, "TRITON_AVAILABLE", False)
    with pytest.raises(RuntimeError, match="kernels"):
        dispatch.backend_for(torch.zeros(1))


@pytest.mark.parametrize(
    "value,want", [(None, None), ("", None), ("auto", None), ("triton", "triton"), (" Torch ", "torch")]
)
def test_env_var_parsing(value, want):
    assert dispatch.parse_backend_env(value) == want


def test_env_var_rejects_unknown():
    with pytest.raises(ValueError, match="STREAM_RLHF_KERNELS='cuda'"):
        dispatch.parse_backend_env("cuda")


def test_log_probs_are_fp32_math_under_bf16_autocast():
    """Mixed precision keeps the LM head's log-probs in fp32: autocast does not reach the kernels."""
    g = torch.Generator().manual_seed(5)
    hidden, weight = torch.randn(7, 16, generator=g), torch.randn(30, 16, generator=g)
    labels = torch.randint(0, 30, (7,), generator=g)
    plain = logprobs_from_hidden(hidden, weight, labels, 0.7, with_entropy=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mixed = logprobs_from_hidden(hidden, weight, labels, 0.7, with_entropy=True)
        from_logits = logprobs_from_logits(hidden @ weight.T, labels, 0.7)[0]  # bf16 logits, fp32 log-softmax
    assert torch.equal(plain[0], mixed[0]) and torch.equal(plain[1], mixed[1])
    assert from_logits.dtype == torch.float32
