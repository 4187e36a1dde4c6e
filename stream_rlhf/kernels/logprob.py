"""Token log-probs and entropies that never hold the (T, V) log-softmax: fused Triton or chunked torch.

    logp, ent = logprobs_from_logits(logits, labels, temperature, with_entropy=True)        # (..., V)
    logp, ent = logprobs_from_hidden(hidden, weight, labels, temperature, with_entropy=True)  # (..., H), (V, H)

Both are differentiable and return fp32 (...) tensors (`ent` is None unless asked for); gradients
come back in the inputs' dtype. Both run outside `torch.autocast` (mixed precision keeps the LM
head's log-probs in fp32, `backends/precision.py`). `temperature <= 0` means 1.0 (greedy
decoding's log-probs are of the untempered distribution). Labels must lie in [0, V).

Backends (`dispatch.backend_for`):
    triton  `stream_rlhf/kernels/triton_logprob.py`: online log-sum-exp over vocabulary tiles, forward and
            backward; the hidden-state form never materialises the logits either.
    torch   logits form: a custom autograd Function over slices of rows (forward and backward), so
            it holds one slice's fp32 softmax at a time. Hidden form: a custom
            autograd Function that walks V in `chunk_size` slices, forward (online LSE) and backward
            (recomputing each slice), so it holds at most (T, chunk_size) logits, even on CPU.
The naive references (`reference_*`) sit at the bottom; tests and `bench/` compare against them.
"""

from __future__ import annotations

import torch
from torch import Tensor

from stream_rlhf.kernels.dispatch import backend_for

# Triton tile sizes (not tuned on hardware yet); tests shrink them to exercise the chunk loops.
TRITON_LOGITS_BLOCK_V = 2048
TRITON_HIDDEN_BLOCKS = (64, 128, 64)  # (BLOCK_T, BLOCK_V, BLOCK_K)


def _inv_temperature(temperature: float) -> float:
    return 1.0 / temperature if temperature > 0 else 1.0


# ----------------------------------------------------------------------------------------------
# Public entry points
# ----------------------------------------------------------------------------------------------


def logprobs_from_logits(
    logits: Tensor, labels: Tensor, temperature: float = 1.0, with_entropy: bool = False
) -> tuple[Tensor, Tensor | None]:
    """log softmax(logits / temperature)[labels] and the entropy: (..., V), (...) -> (...) fp32 each."""
    lead = labels.shape
    logits2d = logits.reshape(-1, logits.shape[-1])  # (T, V)
    if logits2d.stride(-1) != 1:
        logits2d = logits2d.contiguous()
    labels1d = labels.reshape(-1).contiguous()
    with torch.autocast(logits.device.type, enabled=False):
        if backend_for(logits) == "triton":
            logp, ent = _TritonLogits.apply(logits2d, labels1d, _inv_temperature(temperature))
        else:
            logp, ent = _ChunkedLogits.apply(logits2d, labels1d, _inv_temperature(temperature))
    return logp.reshape(lead), ent.reshape(lead) if with_entropy else None


def logprobs_from_hidden(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk_size: int = 4096,
) -> tuple[Tensor, Tensor | None]:
    """Same as logprobs_from_logits(hidden @ weight.T, ...) without the logits: hidden (..., H), weight (V, H).

    `chunk_size` is the vocabulary slice of the torch path; the Triton path uses its own tiles.
    """
    if hidden.dtype != weight.dtype:
        raise ValueError(f"hidden.dtype={hidden.dtype} != weight.dtype={weight.dtype}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size}: must be >= 1")
    lead = labels.shape
    hidden2d = hidden.reshape(-1, hidden.shape[-1]).contiguous()  # (T, H)
    labels1d = labels.reshape(-1).contiguous()  # (T,)
    inv_temp = _inv_temperature(temperature)
    with torch.autocast(hidden.device.type, enabled=False):
        if backend_for(hidden) == "triton":
            logp, ent = _TritonHidden.apply(hidden2d, weight.contiguous(), labels1d, inv_temp)
        else:
            logp, ent = _ChunkedHidden.apply(hidden2d, weight, labels1d, inv_temp, chunk_size)
    return logp.reshape(lead), ent.reshape(lead) if with_entropy else None


# ----------------------------------------------------------------------------------------------
# Triton path (kernels and their math: stream_rlhf/kernels/triton_logprob.py)
# ----------------------------------------------------------------------------------------------


def _grad_or_none(g: Tensor | None) -> Tensor | None:
    return None if g is None else g.float().contiguous()


class _TritonLogits(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: Tensor, labels: Tensor, inv_temp: float) -> tuple[Tensor, Tensor]:
        from stream_rlhf.kernels import triton_logprob as fused_logprob

        logp, ent, lse, ez = fused_logprob.logits_forward(logits, labels, inv_temp, TRITON_LOGITS_BLOCK_V)
        ctx.save_for_backward(logits, labels, lse, ez)
        ctx.inv_temp = inv_temp
        ctx.set_materialize_grads(False)
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp: Tensor | None, g_ent: Tensor | None):
        from stream_rlhf.kernels import triton_logprob as fused_logprob

        logits, labels, lse, ez = ctx.saved_tensors
        if g_logp is None and g_ent is None:
            return None, None, None
        dlogits = fused_logprob.logits_backward(
            logits, labels, lse, ez, _grad_or_none(g_logp), _grad_or_none(g_ent), ctx.inv_temp,
            TRITON_LOGITS_BLOCK_V,
        )  # fmt: skip
        return dlogits, None, None


class _TritonHidden(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, labels: Tensor, inv_temp: float) -> tuple[Tensor, Tensor]:
        from stream_rlhf.kernels import triton_logprob as fused_logprob

        bt, bv, bk = TRITON_HIDDEN_BLOCKS
        logp, ent, lse, ez = fused_logprob.hidden_forward(hidden, weight, labels, inv_temp, bt, bv, bk)
        ctx.save_for_backward(hidden, weight, labels, lse, ez)
        ctx.inv_temp = inv_temp
        ctx.set_materialize_grads(False)
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp: Tensor | None, g_ent: Tensor | None):
        from stream_rlhf.kernels import triton_logprob as fused_logprob

        hidden, weight, labels, lse, ez = ctx.saved_tensors
        need_dh, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if (g_logp is None and g_ent is None) or not (need_dh or need_dw):
            return None, None, None, None
        bt, bv, bk = TRITON_HIDDEN_BLOCKS
        dhidden, dweight = fused_logprob.hidden_backward(
            hidden, weight, labels, lse, ez, _grad_or_none(g_logp), _grad_or_none(g_ent), ctx.inv_temp,
            need_dhidden=need_dh, need_dweight=need_dw, block_t=bt, block_v=bv, block_k=bk,
        )  # fmt: skip
        return dhidden, dweight, None, None


# ----------------------------------------------------------------------------------------------
# Torch path for the logits form: chunked over rows, forward and backward
# ----------------------------------------------------------------------------------------------

TORCH_CHUNK_ELEMENTS = 1 << 22
"""Rows per slice of the torch logits path: as many as fit in this many fp32 values (16 MiB)."""


class _ChunkedLogits(torch.autograd.Function):
    """Walks the rows in slices of at most TORCH_CHUNK_ELEMENTS values through two reused fp32
    buffers (the tempered slice z and its softmax numerators p), so nothing of size (T, V) is
    allocated besides d logits, which autograd needs anyway. All per-row results go into
    preallocated (T,) tensors: no allocation per slice that could fragment the heap. Backward
    recomputes each slice:  dz = g_logp (onehot - p) - g_ent p (z - ez);  dlogits = dz / temperature
    """

    @staticmethod
    def forward(ctx, logits: Tensor, labels: Tensor, inv_temp: float):
        T, V = logits.shape
        rows = max(1, min(T, TORCH_CHUNK_ELEMENTS // V))
        lse, ez, logp = (torch.empty(T, device=logits.device) for _ in range(3))
        z_buf, p_buf = (torch.empty(rows, V, device=logits.device) for _ in range(2))
        for r0 in range(0, T, rows):
            r1 = min(r0 + rows, T)
            z, p = _softmax_numerators(logits[r0:r1], inv_temp, z_buf[: r1 - r0], p_buf[: r1 - r0])
            total = p.sum(-1)  # (c,)
            lse[r0:r1] = z.amax(-1) + total.log()
            ez[r0:r1] = p.mul_(z).sum(-1) / total
            logp[r0:r1] = z.gather(-1, labels[r0:r1, None]).squeeze(-1) - lse[r0:r1]
        ctx.save_for_backward(logits, labels, lse, ez)
        ctx.inv_temp, ctx.rows = inv_temp, rows
        ctx.set_materialize_grads(False)
        return logp, lse - ez

    @staticmethod
    def backward(ctx, g_logp: Tensor | None, g_ent: Tensor | None):
        logits, labels, lse, ez = ctx.saved_tensors
        if g_logp is None and g_ent is None:
            return None, None, None
        g_logp = torch.zeros_like(lse) if g_logp is None else g_logp.float()
        g_ent = torch.zeros_like(lse) if g_ent is None else g_ent.float()
        T, V = logits.shape
        dlogits = torch.empty_like(logits)
        z_buf, p_buf = (torch.empty(ctx.rows, V, device=logits.device) for _ in range(2))
        for r0 in range(0, T, ctx.rows):
            r1 = min(r0 + ctx.rows, T)
            z = z_buf[: r1 - r0].copy_(logits[r0:r1]).mul_(ctx.inv_temp)  # (c, V) fp32
            p = torch.sub(z, lse[r0:r1, None], out=p_buf[: r1 - r0]).exp_()  # (c, V) softmax
            z.sub_(ez[r0:r1, None]).mul_(g_ent[r0:r1, None]).add_(g_logp[r0:r1, None])
            dz = p.mul_(z).neg_()  # -p (g_logp + g_ent (z - ez))
            dz.scatter_add_(-1, labels[r0:r1, None], g_logp[r0:r1, None])
            dlogits[r0:r1].copy_(dz.mul_(ctx.inv_temp))
        return dlogits, None, None


def _softmax_numerators(logits: Tensor, inv_temp: float, z_out: Tensor, p_out: Tensor) -> tuple[Tensor, Tensor]:
    """z = logits * inv_temp and p = exp(z - max z) per row, written into the given fp32 buffers."""
    z = z_out.copy_(logits).mul_(inv_temp)  # (c, V), scaled in fp32
    p = torch.sub(z, z.amax(-1, keepdim=True), out=p_out).exp_()  # (c, V)
    return z, p


# ----------------------------------------------------------------------------------------------
# Torch path for the hidden-state form: chunked over V, forward and backward
# ----------------------------------------------------------------------------------------------


class _ChunkedHidden(torch.autograd.Function):
    """Online LSE over vocabulary slices of `chunk` rows of weight; backward recomputes each slice.

    Per row: lse = logsumexp_c(lse_c), ez = sum_c exp(lse_c - lse) ez_c, where (lse_c, ez_c) are the
    slice's log-sum-exp and softmax mean of z. Gradient per slice, as in the Triton kernels:
        dz = g_logp (onehot - p) - g_ent p (z - ez);  dlogits = dz / temperature
    """

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, labels: Tensor, inv_temp: float, chunk: int):
        h32 = hidden.float()  # (T, H)
        lse_parts, ez_parts = [], []
        for v0 in range(0, weight.shape[0], chunk):
            z = (h32 @ weight[v0 : v0 + chunk].float().T) * inv_temp  # (T, C)
            lse_c = torch.logsumexp(z, dim=-1)  # (T,)
            lse_parts.append(lse_c)
            ez_parts.append((torch.exp(z - lse_c[:, None]) * z).sum(-1))
        lse_parts_t, ez_parts_t = torch.stack(lse_parts, -1), torch.stack(ez_parts, -1)  # (T, n_chunks)
        lse = torch.logsumexp(lse_parts_t, dim=-1)  # (T,)
        ez = (torch.exp(lse_parts_t - lse[:, None]) * ez_parts_t).sum(-1)  # (T,)
        z_label = (h32 * weight[labels].float()).sum(-1) * inv_temp  # (T,)
        ctx.save_for_backward(hidden, weight, labels, lse, ez)
        ctx.inv_temp, ctx.chunk = inv_temp, chunk
        ctx.set_materialize_grads(False)
        return z_label - lse, lse - ez

    @staticmethod
    def backward(ctx, g_logp: Tensor | None, g_ent: Tensor | None):
        hidden, weight, labels, lse, ez = ctx.saved_tensors
        need_dh, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if (g_logp is None and g_ent is None) or not (need_dh or need_dw):
            return None, None, None, None, None
        T = hidden.shape[0]
        g_logp = torch.zeros_like(lse) if g_logp is None else g_logp.float()
        g_ent = torch.zeros_like(lse) if g_ent is None else g_ent.float()
        h32 = hidden.float()  # (T, H)
        dh32 = torch.zeros_like(h32) if need_dh else None
        dweight = torch.empty_like(weight) if need_dw else None
        rows = torch.arange(T, device=hidden.device)
        for v0 in range(0, weight.shape[0], ctx.chunk):
            w32 = weight[v0 : v0 + ctx.chunk].float()  # (C, H)
            z = (h32 @ w32.T) * ctx.inv_temp  # (T, C)
            p = torch.exp(z - lse[:, None])
            dz = -p * (g_logp[:, None] + g_ent[:, None] * (z - ez[:, None]))  # (T, C)
            here = (labels >= v0) & (labels < v0 + w32.shape[0])
            dz[rows[here], labels[here] - v0] += g_logp[here]
            dz *= ctx.inv_temp
            if dh32 is not None:
                dh32 += dz @ w32
            if dweight is not None:
                dweight[v0 : v0 + ctx.chunk] = dz.T @ h32
        dhidden = dh32.to(hidden.dtype) if dh32 is not None else None
        return dhidden, dweight, None, None, None


# ----------------------------------------------------------------------------------------------
# Naive eager references (they materialise the (T, V) log-softmax)
# ----------------------------------------------------------------------------------------------


def reference_logprobs_from_logits(
    logits: Tensor, labels: Tensor, temperature: float = 1.0, with_entropy: bool = False
) -> tuple[Tensor, Tensor | None]:
    """log_softmax + gather, entropy from the softmax: (..., V), (...) -> (...) fp32 each."""
    scaled = logits.float()
    if temperature > 0:
        scaled = scaled / temperature
    logsm = torch.log_softmax(scaled, dim=-1)  # (..., V)
    logp = logsm.gather(-1, labels.unsqueeze(-1)).squeeze(-1)  # (...)
    ent = -(logsm.exp() * logsm).sum(-1) if with_entropy else None
    return logp, ent


def reference_logprobs_from_hidden(
    hidden: Tensor, weight: Tensor, labels: Tensor, temperature: float = 1.0, with_entropy: bool = False
) -> tuple[Tensor, Tensor | None]:
    """reference_logprobs_from_logits(hidden @ weight.T, ...): hidden (..., H), weight (V, H)."""
    return reference_logprobs_from_logits(hidden @ weight.T, labels, temperature, with_entropy)
