"""The megatron engine's context-parallel split: this rank's part of each sample's sequence, and its
per-token results gathered back into whole sequences.

    split = ContextSplit(cp=2, rank=parallel.cp_rank)
    width = split.width(longest)              # packed rows are right-padded to a multiple of 2 x cp
    ids = split.take(ids, 1)                  # (R, S) -> (R, S_local), megatron's load-balanced layout
    values = split.gather(values_local)       # (R, S_local, ...) of every cp rank -> (R, S, ...)
    logp = split.combine(mine)                # (P, ...) with zeros where another rank scores -> summed

Under cp > 1 a rank holds S_local = S / cp positions of every packed row: chunks r and 2 x cp - 1 - r
of the row cut into 2 x cp (`kernels/cp_gather.py`, `megatron.core.utils.get_batch_on_this_cp_rank`).
The engine gives megatron this rank's tokens, the packed mask's rows of its positions (all S columns:
the attention, `cp_attention.py`, gathers every key) and the whole (3, R, S) positions, whose rotary
embedding megatron cuts into the same chunks itself. Values are computed at the local positions and
all-gathered as (R, S_local) floats per rank (`cp_gather`); log-probs, whose (position, next token)
pairs do not follow the rows when a prompt is shared, are scored by the rank holding the position
and summed over cp as (P,) floats (`combine`); never hidden states or logits. With cp = 1 every
call returns its input.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from megatron.core import parallel_state as ps  # noqa: E402
from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region  # noqa: E402
from torch import Tensor

from stream_rlhf.kernels.cp_gather import cp_gather, sequence_order, shard

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
        return shard(x, self.cp, self.rank, LAYOUT, dim)

    def locate(self, width: int) -> tuple[Tensor, Tensor]:
        """Where each of `width` positions lives: the cp rank that holds it (S,) and its index in
        that rank's part (S,)."""
        if self.cp == 1:
            return torch.zeros(width, dtype=torch.long), torch.arange(width)
        order = sequence_order(width, self.cp, LAYOUT)  # where each position sits in the ranks' parts end to end
        return order // (width // self.cp), order % (width // self.cp)

    def combine(self, mine: Tensor) -> Tensor:
        """The sum over the cp group of each rank's `mine` (zero where another rank wrote), the same
        on every rank; the backward passes the gradient through unchanged, so each rank's entries get
        theirs only (as `gather`)."""
        if self.cp == 1:
            return mine
        return reduce_from_tensor_model_parallel_region(mine, group=ps.get_context_parallel_group())

    def gather(self, local: Tensor) -> Tensor:
        """(B, S_local, ...) of every rank of the cp group -> (B, S, ...) in sequence order, the same
        on every rank; the backward passes on this rank's positions' gradient only (`cp_gather`)."""
        if self.cp == 1:
            return local
        return cp_gather(local, self.cp, self.rank, LAYOUT, ps.get_context_parallel_group())

