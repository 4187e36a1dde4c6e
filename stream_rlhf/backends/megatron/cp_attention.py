"""Context-parallel core attention for the megatron engine's local layer spec (no transformer-engine).

    spec = with_cp_attention(get_gpt_layer_local_spec(normalization="RMSNorm"))   # when cp > 1

megatron-core 0.16's own `DotProductAttention` refuses context parallelism (only transformer-engine's
attention, CUDA-only, has it). Under cp each rank holds its part of the sequence in megatron's
load-balanced layout (`kernels/cp_gather.py`: 2 * cp chunks, rank r holds chunks r and
2 * cp - 1 - r). `CPDotProductAttention` all-gathers the keys and values over the cp group (their
backward reduce-scatters the gradients back to the rank that holds them), puts them in sequence
order, and runs megatron's own dot-product attention of the rank's (S_local) queries against all
(S) keys under the explicit (1, 1, S_local, S) mask the engine passes (`context.py`: the causal
mask's rows of the local positions). Same arithmetic as cp = 1, so exact in fp32; it moves
2 x S x (key/value heads x head dim) floats per layer and rank, where ring attention would overlap
that with compute.
"""

from __future__ import annotations

import dataclasses

import torch
from megatron.core import parallel_state as ps  # noqa: E402
from megatron.core.tensor_parallel import gather_from_sequence_parallel_region  # noqa: E402
from megatron.core.transformer.dot_product_attention import DotProductAttention  # noqa: E402
from megatron.core.transformer.spec_utils import ModuleSpec  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402
from torch import Tensor

from stream_rlhf.backends.megatron.context import LAYOUT
from stream_rlhf.kernels.cp_gather import sequence_order


class CPDotProductAttention(DotProductAttention):
    """megatron's DotProductAttention of local queries against keys and values gathered over cp.

    query (S_local, B, heads, d), key and value (S_local, B, groups, d) in the load-balanced layout;
    attention_mask (1, 1, S_local, S) bool, True = masked out; returns (S_local, B, heads x d)."""

    def __init__(self, config: TransformerConfig, *args, **kwargs):
        self.cp_size = config.context_parallel_size
        super().__init__(dataclasses.replace(config, context_parallel_size=1), *args, **kwargs)  # the parent's check
        self.config = config
        self._orders: dict[tuple[int, torch.device], Tensor] = {}  # (S, device) -> sequence order there

    def forward(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                *args, **kwargs) -> Tensor:
        if attention_mask is None:
            raise ValueError("megatron cp attention: needs the explicit (1, 1, S_local, S) mask")
        group = ps.get_context_parallel_group()
        order = self._sequence_order(key.shape[0] * self.cp_size, key.device)  # (S,)
        key = gather_from_sequence_parallel_region(key, group=group).index_select(0, order)  # (S, B, groups, d)
        value = gather_from_sequence_parallel_region(value, group=group).index_select(0, order)
        return super().forward(query, key, value, attention_mask, *args, **kwargs)

    def _sequence_order(self, length: int, device: torch.device) -> Tensor:
        """(S,) indices into the rank-order gather (rank 0's positions, rank 1's, ...) in sequence
        order, on `device` (kept: every forward of a batch width asks again)."""
        if (length, device) not in self._orders:
            self._orders[length, device] = sequence_order(length, self.cp_size, LAYOUT).to(device)
        return self._orders[length, device]


def with_cp_attention(spec: ModuleSpec) -> ModuleSpec:
    """`spec` (a local GPT layer spec) with its core attention swapped for `CPDotProductAttention`."""
    spec.submodules.self_attention.submodules.core_attention = CPDotProductAttention
    return spec
