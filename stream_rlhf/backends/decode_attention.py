"""Attention for the sampler's decode steps: two small matmuls instead of SDPA's kernel.

    use_decode_attention(model)       # once, after loading the rollout model
    generate(model, prompts, params)  # decode steps take the matmul path, prefill stays on SDPA

A decode step asks attention for ONE query token per row against the row's cache. On the CPU,
`scaled_dot_product_attention` pays a fixed cost per call that dwarfs that work: for 64 rows x 8
heads x 40 cached positions it took 1.03 ms against 0.36 ms for `softmax(q @ k^T) @ v` written
out (one thread, torch 2.13), a sixth of a 12M model's decode time. On the CPU a step of several
positions per row over a masked cache (the turn sampler's joins, `episode_sampler.py`) takes the
same path: SDPA would first copy the whole cache to repeat its kv heads for grouped-query
attention. Every other call (a prefill without a cache mask, CUDA's several-position steps,
training) goes to Hugging Face's own SDPA function.

The sampler's KV cache hands attention its whole buffers, (B, Hkv, capacity, D), with the slots
not written yet masked in every row (`kv_cache.py`); a decode step attends only to the written
prefix on the CPU, a view whose batched matmuls need no copy: 64 rows x 48 steps of the 12M model
decode in 1.40 s instead of 1.52 s (one thread, Intel Xeon with AVX-512), the same tokens. (On
CUDA it attends to the whole buffer: finding the prefix would stall the device once a layer.)

The implementation registers under one name with Hugging Face's attention and mask tables, so
the model's mask is built exactly as for SDPA (boolean, (B, 1, Q, K), or None when causal
masking alone is enough) and the model's other code does not change. Grouped-query attention
folds the query heads of one key/value head into the query dimension rather than copying the
cache (`repeat_kv`).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "stream_rlhf_decode"


def decode_attention_forward(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: object,
) -> tuple[Tensor, None]:
    """query (B, H, Q, D), key/value (B, Hkv, K, D), mask bool (B, 1, Q, K) or None -> (B, Q, H, D)."""
    batch, heads, q_len, dim = query.shape
    # a slot cache's step: every query sees some key (a left-padded prefill's padding rows see none)
    several = (q_len > 1 and attention_mask is not None and key.device.type == "cpu"
               and bool(attention_mask.any(-1).all()))
    if (q_len != 1 and not several) or module.training or kwargs.get("position_bias") is not None \
            or kwargs.get("softcap") is not None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if attention_mask is not None and key.device.type == "cpu":  # the cache's unwritten tail (kv_cache.py): left out
        attended = attention_mask.flatten(0, 2).any(0).nonzero()  # (n, 1) key positions some row attends
        used = int(attended[-1]) + 1 if len(attended) else key.shape[2]
        key, value, attention_mask = key[:, :, :used], value[:, :, :used], attention_mask[..., :used]
    kv_heads = key.shape[1]
    group = heads // kv_heads
    scale = dim**-0.5 if scaling is None else scaling
    # (B, Hkv, G*Q, D): the G query heads of one kv head, each with its Q positions
    grouped = query.reshape(batch, kv_heads, group * q_len, dim)
    scores = torch.matmul(grouped, key.transpose(2, 3)) * scale  # (B, Hkv, G*Q, K)
    if attention_mask is not None:  # (B, 1, Q, K) bool, True = attend: the same for every head
        mask = attention_mask[:, :, None].expand(-1, -1, group, -1, -1).reshape(batch, 1, group * q_len, -1)
        scores = scores.masked_fill(mask.logical_not(), float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(value.dtype)  # (B, Hkv, G*Q, K)
    out = torch.matmul(probs, value)  # (B, Hkv, G*Q, D)
    return out.reshape(batch, heads, q_len, value.shape[-1]).transpose(1, 2), None


AttentionInterface.register(NAME, decode_attention_forward)
AttentionMaskInterface.register(NAME, sdpa_mask)


def use_decode_attention(model: nn.Module) -> None:
    """Route `model`'s attention (and its submodels') through `decode_attention_forward`."""
    model.set_attn_implementation(NAME)
