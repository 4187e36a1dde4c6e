"""The megatron engine's context-parallel split: this rank's part of each sample's sequence, and its
per-token results gathered back into whole sequences.

    split = ContextSplit(cp=2, rank=parallel.cp_rank)
    width = split.width(longest)              # batches are right-padded to a multiple of 2 x cp
    ids = split.take(ids, 1)                  # (B, S) -> (B, S_local), megatron's load-balanced layout
    logp = split.gather(logp_local)           # (B, S_local, ...) of every cp rank -> (B, S, ...)

Under cp > 1 a rank holds S_local = S / cp positions: chunks r and 2 x cp - 1 - r of the sequence cut
into 2 x cp (`kernels/cp_gather.py`, `megatron.core.utils.get_batch_on_this_cp_rank`). The engine
gives megatron this rank's tokens, the causal mask's rows of its positions (all S columns: the
attention, `cp_attention.py`, gathers every key) and the whole (3, B, S) M-RoPE positions, whose
rotary embedding megatron cuts into the same chunks itself. Log-probs and values are computed for
the local positions only and all-gathered as (B, S_local) floats per rank (`cp_gather`), never
hidden states or logits. With cp = 1 every call returns its input.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from stream_rlhf.kernels.cp_gather import cp_gather, local_positions, next_token_labels

from megatron.core import parallel_state as ps  # noqa: E402

LAYOUT = "load_balanced"


@dataclass(frozen=True)
class ContextSplit:
    cp: int
    """Context-parallel size."""
    rank: int
    """This rank's place in its context-parallel group."""

    def width(self, longest: int) -> int:
        """The padded sequence length of a batch whose longest sample has `longest` tokens: a
        multiple of 2 x cp, so that the sequence cuts into 2 x cp equal chunks."""
        multiple = 2 * self.cp if self.cp > 1 else 1
        return -(-longest // multiple) * multiple

    def take(self, x: Tensor, dim: int) -> Tensor:
        """`x`'s entries at this rank's positions along `dim` (whose length is the whole sequence)."""
        if self.cp == 1:
            return x
        return x.index_select(dim, local_positions(x.shape[dim], self.cp, self.rank, LAYOUT).to(x.device))

    def labels(self, ids: Tensor) -> Tensor:
        """(B, S_local): the next token of each of this rank's positions in `ids` (B, S); a
        placeholder at the last position, which has none."""
        return next_token_labels(ids, ids.shape[1] // self.cp, self.cp, self.rank, LAYOUT)

    def gather(self, local: Tensor) -> Tensor:
        """(B, S_local, ...) of every rank of the cp group -> (B, S, ...) in sequence order, the same
        on every rank; the backward passes on this rank's positions' gradient only (`cp_gather`)."""
        if self.cp == 1:
            return local
        return cp_gather(local, self.cp, self.rank, LAYOUT, ps.get_context_parallel_group())


def padded_ids(sequences: list[Tensor], width: int) -> Tensor:
    """(B, width) long: `sequences` right-padded with 0."""
    ids = torch.zeros(len(sequences), width, dtype=torch.long)
    for i, seq in enumerate(sequences):
        ids[i, : len(seq)] = seq
    return ids
