"""Fused token log-prob and entropy kernels (forward and backward) that never hold a (T, V) tensor.

    logp, ent, lse, ez = logits_forward(logits, labels, inv_temp, block_v)          # (T, V) -> 4 x (T,)
    dlogits = logits_backward(logits, labels, lse, ez, g_logp, g_ent, inv_temp, block_v)
    logp, ent, lse, ez = hidden_forward(hidden, weight, labels, inv_temp, ...)      # (T, H), (V, H)
    dhidden, dweight = hidden_backward(hidden, weight, labels, lse, ez, g_logp, g_ent, inv_temp, ...)

The PyTorch references and the public, differentiable entry points live in
`stream_rlhf/kernels/logprob.py`; `tests/test_kernels_logprob.py` compares the two.

Math, per row t, with z = x / temperature over the vocabulary v:
    lse   = log sum_v exp(z_v)                     (online over BLOCK_V chunks: running max m,
    ez    = sum_v p_v z_v,   p_v = exp(z_v - lse)   running sum s of exp(z - m), running sum of exp(z - m) * z)
    logp  = z_label - lse
    ent   = lse - ez
Backward, with g_logp and g_ent the incoming gradients of logp and ent:
    dlogp/dz_v = onehot_v - p_v
    dent/dz_v  = -p_v (z_v - ez)
    dx_v       = (g_logp (onehot_v - p_v) - g_ent p_v (z_v - ez)) / temperature
`lse` and `ez` are saved by the forward, so the backward recomputes p chunk by chunk.

Hidden-state form: each logits tile (BLOCK_T, BLOCK_V) = hidden_tile @ weight_tile.T is built with
tl.dot over BLOCK_K slices of H and never stored. The backward runs two kernels so that each output
tile is owned by one program (deterministic, no atomics), at the cost of recomputing the logits
twice: `_hidden_bwd_dhidden_kernel` (one program per BLOCK_T rows, loops over V) and
`_hidden_bwd_dweight_kernel` (one program per BLOCK_V vocabulary rows, loops over T).

Every launch goes through `specialisations.launch`, which records the specialisation Triton
compiles for it; the token count T of the hidden-state kernels is `do_not_specialize` and their
token tile fixed, so one compile per variant serves every length (`backends/kernel_warm_up.py`
launches them at engine setup).

Accumulation is fp32 everywhere. tl.dot runs on the input dtype (bf16 tensor cores), except that
fp32 inputs use input_precision="ieee" (no TF32) and, under TRITON_INTERPRET=1, operands are
upcast to fp32 because the interpreter's bf16 tl.dot returns garbage (triton 3.9).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch import Tensor

from stream_rlhf.kernels.specialisations import UNSPECIALISED, launch

# Read once: the interpreter cannot run bf16 tl.dot, so operands are upcast there.
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


# ----------------------------------------------------------------------------------------------
# Logits form: one program per row t, looping over V in BLOCK_V chunks.
# ----------------------------------------------------------------------------------------------


@triton.jit
def _logits_fwd_kernel(
    logits_ptr, labels_ptr, logp_ptr, ent_ptr, lse_ptr, ez_ptr,
    V, stride_t, inv_temp,
    BLOCK_V: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride_t
    m = tl.max(tl.full((BLOCK_V,), -float("inf"), dtype=tl.float32), axis=0)  # running max of z
    s = tl.sum(tl.zeros((BLOCK_V,), dtype=tl.float32), axis=0)  # running sum of exp(z - m)
    sz = tl.sum(tl.zeros((BLOCK_V,), dtype=tl.float32), axis=0)  # running sum of exp(z - m) * z
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        ok = cols < V
        z = tl.load(base + cols, mask=ok, other=-float("inf")).to(tl.float32) * inv_temp  # (BLOCK_V,)
        m_new = tl.maximum(m, tl.max(z, axis=0))
        alpha = tl.exp(m - m_new)
        e = tl.where(ok, tl.exp(z - m_new), 0.0)
        s = s * alpha + tl.sum(e, axis=0)
        sz = sz * alpha + tl.sum(e * tl.where(ok, z, 0.0), axis=0)  # no -inf * 0 in padded lanes
        m = m_new
    lse = m + tl.log(s)
    ez = sz / s
    label = tl.load(labels_ptr + row)
    z_label = tl.load(base + label).to(tl.float32) * inv_temp
    tl.store(logp_ptr + row, z_label - lse)
    tl.store(ent_ptr + row, lse - ez)
    tl.store(lse_ptr + row, lse)
    tl.store(ez_ptr + row, ez)


@triton.jit
def _logits_bwd_kernel(
    logits_ptr, labels_ptr, lse_ptr, ez_ptr, g_logp_ptr, g_ent_ptr, dlogits_ptr,
    V, stride_t, stride_dt, inv_temp,
    HAS_G_LOGP: tl.constexpr, HAS_G_ENT: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    lse = tl.load(lse_ptr + row)
    ez = tl.load(ez_ptr + row)
    label = tl.load(labels_ptr + row)
    g_logp = 0.0
    g_ent = 0.0
    if HAS_G_LOGP:
        g_logp = tl.load(g_logp_ptr + row)
    if HAS_G_ENT:
        g_ent = tl.load(g_ent_ptr + row)
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        ok = cols < V
        z = tl.load(logits_ptr + row * stride_t + cols, mask=ok, other=0.0).to(tl.float32) * inv_temp
        p = tl.exp(z - lse)  # (BLOCK_V,)
        dz = g_logp * (tl.where(cols == label, 1.0, 0.0) - p) - g_ent * p * (z - ez)
        out = dlogits_ptr + row * stride_dt + cols
        tl.store(out, (dz * inv_temp).to(dlogits_ptr.dtype.element_ty), mask=ok)


def logits_forward(
    logits: Tensor, labels: Tensor, inv_temp: float, block_v: int = 2048
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """logits (T, V) row-contiguous, labels (T,) long -> logp, ent, lse, ez: each (T,) fp32."""
    T, V = logits.shape
    logp, ent, lse, ez = (torch.empty(T, device=logits.device, dtype=torch.float32) for _ in range(4))
    if T == 0:
        return logp, ent, lse, ez
    block_v = min(block_v, triton.next_power_of_2(V))
    args = {"logits_ptr": logits, "labels_ptr": labels, "logp_ptr": logp, "ent_ptr": ent, "lse_ptr": lse,
            "ez_ptr": ez, "V": V, "stride_t": logits.stride(0), "inv_temp": inv_temp}
    launch(_logits_fwd_kernel, (T,), args, {"BLOCK_V": block_v})
    return logp, ent, lse, ez


def logits_backward(
    logits: Tensor, labels: Tensor, lse: Tensor, ez: Tensor,
    g_logp: Tensor | None, g_ent: Tensor | None, inv_temp: float, block_v: int = 2048,
) -> Tensor:  # fmt: skip
    """Gradient wrt logits (T, V), in the logits' dtype; a None gradient counts as zero."""
    T, V = logits.shape
    dlogits = torch.empty_like(logits)
    if T == 0:
        return dlogits
    block_v = min(block_v, triton.next_power_of_2(V))
    args = {
        "logits_ptr": logits, "labels_ptr": labels, "lse_ptr": lse, "ez_ptr": ez,
        "g_logp_ptr": g_logp if g_logp is not None else lse, "g_ent_ptr": g_ent if g_ent is not None else lse,
        "dlogits_ptr": dlogits, "V": V, "stride_t": logits.stride(0), "stride_dt": dlogits.stride(0),
        "inv_temp": inv_temp,
    }  # fmt: skip
    meta = {"HAS_G_LOGP": g_logp is not None, "HAS_G_ENT": g_ent is not None, "BLOCK_V": block_v}
    launch(_logits_bwd_kernel, (T,), args, meta)
    return dlogits


# ----------------------------------------------------------------------------------------------
# Hidden-state form: logits tiles built from hidden (T, H) @ weight (V, H).T, never stored.
# ----------------------------------------------------------------------------------------------


@triton.jit
def _dot(a, b, acc, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """acc += a @ b with fp32 accumulation; UPCAST runs the product in fp32."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision=PRECISION)
    return tl.dot(a, b, acc, input_precision=PRECISION)


@triton.jit
def _logits_tile(
    h_ptr, w_ptr, rows, row_ok, cols, col_ok, H,
    BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """hidden[rows] @ weight[cols].T -> (BLOCK_T, BLOCK_V) fp32; padded rows/cols read zeros."""
    acc = tl.zeros((BLOCK_T, BLOCK_V), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < H
        h = tl.load(h_ptr + rows[:, None] * H + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptr + cols[:, None] * H + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        acc = _dot(h, tl.trans(w), acc, UPCAST, PRECISION)  # (BLOCK_T, BLOCK_K) @ (BLOCK_K, BLOCK_V)
    return acc


@triton.jit(do_not_specialize=UNSPECIALISED)
def _hidden_fwd_kernel(
    h_ptr, w_ptr, labels_ptr, logp_ptr, ent_ptr, lse_ptr, ez_ptr,
    T, V, H, inv_temp,
    BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < T
    labels = tl.load(labels_ptr + rows, mask=row_ok, other=0)  # (BLOCK_T,)
    m = tl.full((BLOCK_T,), -float("inf"), dtype=tl.float32)
    s = tl.zeros((BLOCK_T,), dtype=tl.float32)
    sz = tl.zeros((BLOCK_T,), dtype=tl.float32)
    z_label = tl.zeros((BLOCK_T,), dtype=tl.float32)
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        col_ok = cols < V
        z = _logits_tile(h_ptr, w_ptr, rows, row_ok, cols, col_ok, H, BLOCK_T, BLOCK_V, BLOCK_K, UPCAST, PRECISION)
        z = tl.where(col_ok[None, :], z * inv_temp, -float("inf"))  # (BLOCK_T, BLOCK_V)
        m_new = tl.maximum(m, tl.max(z, axis=1))
        alpha = tl.exp(m - m_new)
        e = tl.where(col_ok[None, :], tl.exp(z - m_new[:, None]), 0.0)
        s = s * alpha + tl.sum(e, axis=1)
        sz = sz * alpha + tl.sum(e * tl.where(col_ok[None, :], z, 0.0), axis=1)
        z_label += tl.sum(tl.where(cols[None, :] == labels[:, None], z, 0.0), axis=1)
        m = m_new
    lse = m + tl.log(s)
    ez = sz / s
    tl.store(logp_ptr + rows, z_label - lse, mask=row_ok)
    tl.store(ent_ptr + rows, lse - ez, mask=row_ok)
    tl.store(lse_ptr + rows, lse, mask=row_ok)
    tl.store(ez_ptr + rows, ez, mask=row_ok)


@triton.jit
def _dz_tile(z, cols, labels, lse, ez, g_logp, g_ent, mask):
    """d(g_logp . logp + g_ent . ent)/dz for one (BLOCK_T, BLOCK_V) tile; zero outside `mask`."""
    p = tl.exp(z - lse[:, None])
    onehot = tl.where(cols[None, :] == labels[:, None], 1.0, 0.0)
    dz = g_logp[:, None] * (onehot - p) - g_ent[:, None] * p * (z - ez[:, None])
    return tl.where(mask, dz, 0.0)


@triton.jit
def _load_row_stats(labels_ptr, lse_ptr, ez_ptr, g_logp_ptr, g_ent_ptr, rows, row_ok,
                    HAS_G_LOGP: tl.constexpr, HAS_G_ENT: tl.constexpr):  # fmt: skip
    labels = tl.load(labels_ptr + rows, mask=row_ok, other=0)
    lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
    ez = tl.load(ez_ptr + rows, mask=row_ok, other=0.0)
    if HAS_G_LOGP:
        g_logp = tl.load(g_logp_ptr + rows, mask=row_ok, other=0.0)
    else:
        g_logp = tl.zeros(lse.shape, dtype=tl.float32)
    if HAS_G_ENT:
        g_ent = tl.load(g_ent_ptr + rows, mask=row_ok, other=0.0)
    else:
        g_ent = tl.zeros(lse.shape, dtype=tl.float32)
    return labels, lse, ez, g_logp, g_ent


@triton.jit(do_not_specialize=UNSPECIALISED)
def _hidden_bwd_dhidden_kernel(
    h_ptr, w_ptr, labels_ptr, lse_ptr, ez_ptr, g_logp_ptr, g_ent_ptr, dh_ptr,
    T, V, H, inv_temp,
    HAS_G_LOGP: tl.constexpr, HAS_G_ENT: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """dhidden[rows] (fp32, zero-initialised) += dz @ weight, one program per BLOCK_T rows."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < T
    labels, lse, ez, g_logp, g_ent = _load_row_stats(
        labels_ptr, lse_ptr, ez_ptr, g_logp_ptr, g_ent_ptr, rows, row_ok, HAS_G_LOGP, HAS_G_ENT
    )
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        col_ok = cols < V
        z = _logits_tile(h_ptr, w_ptr, rows, row_ok, cols, col_ok, H, BLOCK_T, BLOCK_V, BLOCK_K, UPCAST, PRECISION)
        dz = _dz_tile(z * inv_temp, cols, labels, lse, ez, g_logp, g_ent, row_ok[:, None] & col_ok[None, :])
        dz = (dz * inv_temp).to(w_ptr.dtype.element_ty)  # (BLOCK_T, BLOCK_V) d logits
        for k0 in range(0, H, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < H
            w = tl.load(w_ptr + cols[:, None] * H + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
            dh_tile = dh_ptr + rows[:, None] * H + ks[None, :]
            dh_mask = row_ok[:, None] & k_ok[None, :]
            dh = tl.load(dh_tile, mask=dh_mask, other=0.0)  # (BLOCK_T, BLOCK_K) fp32
            dh = _dot(dz, w, dh, UPCAST, PRECISION)
            tl.store(dh_tile, dh, mask=dh_mask)


@triton.jit(do_not_specialize=UNSPECIALISED)
def _hidden_bwd_dweight_kernel(
    h_ptr, w_ptr, labels_ptr, lse_ptr, ez_ptr, g_logp_ptr, g_ent_ptr, dw_ptr,
    T, V, H, inv_temp,
    HAS_G_LOGP: tl.constexpr, HAS_G_ENT: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """dweight[cols] (fp32, zero-initialised) += dz.T @ hidden, one program per BLOCK_V vocab rows."""
    cols = tl.program_id(0).to(tl.int64) * BLOCK_V + tl.arange(0, BLOCK_V)
    col_ok = cols < V
    for t0 in range(0, T, BLOCK_T):
        rows = t0 + tl.arange(0, BLOCK_T).to(tl.int64)
        row_ok = rows < T
        labels, lse, ez, g_logp, g_ent = _load_row_stats(
            labels_ptr, lse_ptr, ez_ptr, g_logp_ptr, g_ent_ptr, rows, row_ok, HAS_G_LOGP, HAS_G_ENT
        )
        z = _logits_tile(h_ptr, w_ptr, rows, row_ok, cols, col_ok, H, BLOCK_T, BLOCK_V, BLOCK_K, UPCAST, PRECISION)
        dz = _dz_tile(z * inv_temp, cols, labels, lse, ez, g_logp, g_ent, row_ok[:, None] & col_ok[None, :])
        dz_t = tl.trans((dz * inv_temp).to(h_ptr.dtype.element_ty))  # (BLOCK_V, BLOCK_T)
        for k0 in range(0, H, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < H
            h = tl.load(h_ptr + rows[:, None] * H + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            dw_tile = dw_ptr + cols[:, None] * H + ks[None, :]
            dw_mask = col_ok[:, None] & k_ok[None, :]
            dw = tl.load(dw_tile, mask=dw_mask, other=0.0)  # (BLOCK_V, BLOCK_K) fp32
            dw = _dot(dz_t, h, dw, UPCAST, PRECISION)
            tl.store(dw_tile, dw, mask=dw_mask)


def _dot_mode(t: Tensor) -> tuple[bool, str]:
    """(upcast operands to fp32, tl.dot input_precision) for inputs of t's dtype."""
    if t.dtype == torch.float32:
        return False, "ieee"
    return _INTERPRET, "ieee" if _INTERPRET else "tf32"


def _blocks(V: int, H: int, block_t: int, block_v: int, block_k: int) -> tuple[int, int, int]:
    """Shrink the vocabulary and hidden tiles to the model, keeping every tl.dot dimension >= 16. The
    token tile stays `block_t` whatever T is: T only masks rows, so one compile serves every length."""
    return (
        max(16, block_t),
        max(16, min(block_v, triton.next_power_of_2(V))),
        max(16, min(block_k, triton.next_power_of_2(H))),
    )


def hidden_forward(
    hidden: Tensor, weight: Tensor, labels: Tensor, inv_temp: float,
    block_t: int = 64, block_v: int = 128, block_k: int = 64,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """hidden (T, H), weight (V, H) contiguous, same dtype; labels (T,) long -> logp, ent, lse, ez (T,) fp32."""
    (T, H), V = hidden.shape, weight.shape[0]
    logp, ent, lse, ez = (torch.empty(T, device=hidden.device, dtype=torch.float32) for _ in range(4))
    if T == 0:
        return logp, ent, lse, ez
    bt, bv, bk = _blocks(V, H, block_t, block_v, block_k)
    upcast, precision = _dot_mode(hidden)
    args = {"h_ptr": hidden, "w_ptr": weight, "labels_ptr": labels, "logp_ptr": logp, "ent_ptr": ent,
            "lse_ptr": lse, "ez_ptr": ez, "T": T, "V": V, "H": H, "inv_temp": inv_temp}
    meta = {"BLOCK_T": bt, "BLOCK_V": bv, "BLOCK_K": bk, "UPCAST": upcast, "PRECISION": precision}
    launch(_hidden_fwd_kernel, (triton.cdiv(T, bt),), args, meta)
    return logp, ent, lse, ez


def hidden_backward(
    hidden: Tensor, weight: Tensor, labels: Tensor, lse: Tensor, ez: Tensor,
    g_logp: Tensor | None, g_ent: Tensor | None, inv_temp: float,
    need_dhidden: bool = True, need_dweight: bool = True,
    block_t: int = 64, block_v: int = 128, block_k: int = 64,
) -> tuple[Tensor | None, Tensor | None]:  # fmt: skip
    """(dhidden (T, H), dweight (V, H)) in the inputs' dtype; None where not needed."""
    (T, H), V = hidden.shape, weight.shape[0]
    bt, bv, bk = _blocks(V, H, block_t, block_v, block_k)
    upcast, precision = _dot_mode(hidden)
    args = {
        "h_ptr": hidden, "w_ptr": weight, "labels_ptr": labels, "lse_ptr": lse, "ez_ptr": ez,
        "g_logp_ptr": g_logp if g_logp is not None else lse, "g_ent_ptr": g_ent if g_ent is not None else lse,
    }  # fmt: skip
    sizes = {"T": T, "V": V, "H": H, "inv_temp": inv_temp}
    meta = {
        "HAS_G_LOGP": g_logp is not None, "HAS_G_ENT": g_ent is not None,
        "BLOCK_T": bt, "BLOCK_V": bv, "BLOCK_K": bk, "UPCAST": upcast, "PRECISION": precision,
    }  # fmt: skip
    dhidden = dweight = None
    if need_dhidden:
        dh32 = torch.zeros(T, H, device=hidden.device, dtype=torch.float32)
        if T > 0:
            launch(_hidden_bwd_dhidden_kernel, (triton.cdiv(T, bt),), {**args, "dh_ptr": dh32, **sizes}, meta)
        dhidden = dh32.to(hidden.dtype)
    if need_dweight:
        dw32 = torch.zeros(V, H, device=weight.device, dtype=torch.float32)
        if T > 0:
            launch(_hidden_bwd_dweight_kernel, (triton.cdiv(V, bv),), {**args, "dw_ptr": dw32, **sizes}, meta)
        dweight = dw32.to(weight.dtype)
    return dhidden, dweight
