"""Context-parallel token log-probs: each rank scores its own positions, only the log-probs travel.

Under context parallelism (cp) a sequence of length S is split over `cp_size` ranks, each holding
S_local = S / cp_size positions of the hidden states and logits. Two layouts of the positions:

    contiguous      rank r holds [r * S_local, (r + 1) * S_local)
    load_balanced   Megatron's: the sequence is cut into 2 * cp_size chunks of C = S / (2 * cp_size);
                    rank r holds chunk r and chunk 2 * cp_size - 1 - r, concatenated, so that every
                    rank gets the same share of causal-attention work

    S = 8, cp_size = 2:   contiguous     rank 0: 0 1 2 3      rank 1: 4 5 6 7
                          load_balanced  rank 0: 0 1 6 7      rank 1: 2 3 4 5

The label of global position p is input_ids[:, p + 1]. Every rank has the full input_ids (B * S
ints), so it can look up the next token of its last position even when that token sits on another
rank: the label shift across shard boundaries needs no communication. Each rank computes its
(B, S_local) fp32 log-probs with the fused kernels (`stream_rlhf.kernels.logprob`), and only those
are all-gathered and put back in sequence order. Data each rank sends, in elements:

    gathering logits          B * S_local * V      (B=1, S=32768, cp=4, V=152064: 1.2e9, 2.5 GB in bf16)
    gathering hidden states   B * S * H total,     B * S_local * H per rank (then every rank forms B * S * V logits)
    this module               B * S_local floats   (same example: 8192 floats, 32 KB)

Gradients. `cp_token_logprobs*` and `cp_gather` return the gathered tensor, identical on every
rank, and differentiable with respect to the rank's OWN inputs only: the all-gather's backward
returns the rank's slice of the incoming gradient (no communication). That is the right gradient
when every rank computes the same loss over the gathered tensor and parameter gradients are then
summed (or averaged, with the loss scaled to match) over the cp group, as Megatron does: each rank
contributes the part of dL/dθ that flows through its own positions. (torch.distributed.nn's
all_gather instead reduce-scatters the gradient, which assumes each rank's loss is a different term
of a sum; with a replicated loss it would count every term cp_size times.)

Position S - 1 has no label: the rank holding it scores it against a placeholder label and the
result is dropped after the gather, so it gets no gradient.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Literal

import torch
import torch.distributed as dist

from stream_rlhf.kernels.logprob import logprobs_from_hidden, logprobs_from_logits

Layout = Literal["contiguous", "load_balanced"]
LAYOUTS: tuple[Layout, ...] = ("contiguous", "load_balanced")


def local_positions(seq_len: int, cp_size: int, rank: int, layout: Layout) -> torch.Tensor:
    """Global positions (S_local,) int64 held by `rank`, in the order the rank stores them."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r}: must be one of {LAYOUTS}")
    if cp_size < 1 or not 0 <= rank < cp_size:
        raise ValueError(f"cp_size={cp_size}, rank={rank}: need cp_size >= 1 and 0 <= rank < cp_size")
    pieces = cp_size if layout == "contiguous" else 2 * cp_size
    if seq_len % pieces:
        raise ValueError(
            f"seq_len={seq_len} is not divisible by {pieces} (cp_size={cp_size}, layout={layout!r} "
            f"splits the sequence into {pieces} equal chunks)"
        )
    chunk = seq_len // pieces
    if layout == "contiguous":
        return torch.arange(rank * chunk, (rank + 1) * chunk)
    mirror = 2 * cp_size - 1 - rank
    return torch.cat(
        [torch.arange(rank * chunk, (rank + 1) * chunk), torch.arange(mirror * chunk, (mirror + 1) * chunk)]
    )


def shard(x: torch.Tensor, cp_size: int, rank: int, layout: Layout, dim: int = 1) -> torch.Tensor:
    """The part of x (B, S, ...) that `rank` holds: (B, S_local, ...) (the sequence along `dim`)."""
    positions = local_positions(x.shape[dim], cp_size, rank, layout).to(x.device)  # (S_local,)
    return x.index_select(dim, positions)


@lru_cache(maxsize=64)
def sequence_order(seq_len: int, cp_size: int, layout: Layout) -> torch.Tensor:
    """(S,) indices into the ranks' positions laid end to end (rank 0's, rank 1's, ...) in sequence
    order: `order[p]` is where position p sits there (its rank is order[p] // S_local). Cached: the
    same few lengths recur in every layer and step."""
    stored = torch.cat([local_positions(seq_len, cp_size, r, layout) for r in range(cp_size)])  # (S,)
    return torch.argsort(stored)


class _AllGatherOwnGrad(torch.autograd.Function):
    """all_gather of (B, S_local, ...) into (cp_size, B, S_local, ...); backward: this rank's slice."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, cp_size: int, rank: int, group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.rank = rank
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(cp_size)]
        dist.all_gather(parts, x, group=group)
        return torch.stack(parts)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return grad[ctx.rank], None, None, None


def cp_gather(
    values_local: torch.Tensor, cp_size: int, rank: int, layout: Layout, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Gather every rank's (B, S_local, ...) and put it back in sequence order: (B, S, ...).

    Collective over `group` (the default group when None), whose size must be cp_size; with
    cp_size 1 no process group is needed. Differentiable for this rank's own positions.
    """
    if cp_size == 1:
        return values_local
    if dist.get_world_size(group) != cp_size or dist.get_rank(group) != rank:
        raise ValueError(
            f"cp_size={cp_size}, rank={rank} do not match the process group "
            f"(size {dist.get_world_size(group)}, rank {dist.get_rank(group)})"
        )
    seq_local = values_local.shape[1]
    gathered = _AllGatherOwnGrad.apply(values_local, cp_size, rank, group)  # (cp, B, S_local, ...)
    stored = torch.cat(gathered.unbind(0), dim=1)  # (B, S, ...) in rank order
    return stored.index_select(1, sequence_order(seq_local * cp_size, cp_size, layout).to(stored.device))


def _next_token_labels(
    input_ids: torch.Tensor, seq_local: int, cp_size: int, rank: int, layout: Layout
) -> torch.Tensor:
    """Labels (B, S_local) of this rank's positions: input_ids[:, p + 1], a placeholder at p = S - 1."""
    seq_len = input_ids.shape[1]
    positions = local_positions(seq_len, cp_size, rank, layout)  # (S_local,)
    if positions.numel() != seq_local:
        raise ValueError(
            f"local length {seq_local} != seq_len={seq_len} / cp_size={cp_size} = {positions.numel()}"
        )
    next_positions = (positions + 1).clamp(max=seq_len - 1).to(input_ids.device)  # (S_local,)
    return input_ids.index_select(1, next_positions)


def cp_token_logprobs(
    logits_local: torch.Tensor,
    input_ids: torch.Tensor,
    cp_size: int,
    rank: int,
    layout: Layout,
    group: dist.ProcessGroup | None = None,
    temperature: float = 1.0,
) -> torch.Tensor:
    """log p(input_ids[:, p + 1]) for every position p < S - 1: (B, S - 1) fp32, same on every rank.

    logits_local: (B, S_local, V) this rank's logits; input_ids: (B, S) the full sequence.
    """
    batch, seq_local, vocab = logits_local.shape
    labels = _next_token_labels(input_ids, seq_local, cp_size, rank, layout)  # (B, S_local)
    logp, _ = logprobs_from_logits(logits_local.reshape(-1, vocab), labels.reshape(-1), temperature=temperature)
    full = cp_gather(logp.float().view(batch, seq_local), cp_size, rank, layout, group)  # (B, S)
    return full[:, :-1]


def cp_token_logprobs_from_hidden(
    hidden_local: torch.Tensor,
    weight: torch.Tensor,
    input_ids: torch.Tensor,
    cp_size: int,
    rank: int,
    layout: Layout,
    group: dist.ProcessGroup | None = None,
    temperature: float = 1.0,
) -> torch.Tensor:
    """As `cp_token_logprobs`, from hidden states (B, S_local, H) and the LM head weight (V, H).

    The local logits are never formed: `logprobs_from_hidden` works a chunk of tokens at a time.
    """
    batch, seq_local, hidden_size = hidden_local.shape
    labels = _next_token_labels(input_ids, seq_local, cp_size, rank, layout)  # (B, S_local)
    flat_hidden = hidden_local.reshape(-1, hidden_size)  # (B * S_local, H)
    logp, _ = logprobs_from_hidden(flat_hidden, weight, labels.reshape(-1), temperature=temperature)
    full = cp_gather(logp.float().view(batch, seq_local), cp_size, rank, layout, group)  # (B, S)
    return full[:, :-1]
