"""The megatron engine's micro-batch: sequences packed padding-free into rows, and each sequence's
per-token results read back out of the rows.

    run = run_of(sequences, images, prompt_lens, vision_config)     # the packing, on the host
    batch = packed_batch(run, split, vision_config, device)         # shape=common_shape(runs, split) under pp > 1
    out = model(split.take(batch.ids, 1), batch.positions, batch.mask)
    logp, entropy = token_logprobs(out, head_weight, batch, sequences, 0.7, True, split)
    values = token_values(out, batch, split)

The layout is the torch engine's (`models/packing.py`, `packed_layout`): several sequences per row,
positions restarting at 0 per sequence (M-RoPE ones per sequence for a vision-language model), and
with `prompt_lens` (text models) the samples of one prompt sharing one copy of it. megatron gets
the layout's attention mask as its explicit mask, inverted (True = masked out): block-diagonal
causal, a shared prompt's samples each seeing the prompt and their own response only. Rows are
right-padded to a multiple of 2 x cp under context parallelism (`context.py`), and under pipeline
parallelism every micro-batch of a step to one shape (rows and width: the schedule passes
activations of one shape between stages); padding attends to itself only. Every model takes
(3, R, C) positions: megatron's `rope` numbers positions 0..S-1 by itself, so the engine runs a
text model's rotary embedding as M-RoPE too, its three rows equal (`model.py`).

Log-probs are those of each (position, next token) pair of the layout, each pair once
(`next_token_pairs`), by the fused kernel on the hidden states of the pairs' positions. Under cp > 1
each rank scores the pairs whose position it holds and the pairs' (P,) floats (with entropy (P, 2))
are summed over cp (`ContextSplit.combine`); values are (R, C_local) per rank, all-gathered over
cp (`ContextSplit.gather`). Neither moves hidden states or logits.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from stream_rlhf.backends.megatron.context import ContextSplit
from stream_rlhf.kernels import logprobs_from_hidden
from stream_rlhf.models.packing import Packed, next_token_pairs, packed_layout, vision_inputs
from stream_rlhf.samples import SampleImages


class Batch(NamedTuple):
    ids: Tensor
    """(R, C) long: the packed rows, right-padded with 0 (C a multiple of 2 x cp under cp > 1), and
    padding rows below them when padded to a step's common shape."""
    positions: Tensor
    """(3, R, C) long: each sequence's positions from 0 (M-RoPE ones with images; a text model's
    three rows equal); 0 on padding."""
    mask: Tensor
    """(R, 1, C_local, C) bool, True = masked out: the layout's attention mask, inverted, at the
    queries of this cp rank's positions (C_local = C / cp; taken before it goes to the device)."""
    features: Tensor | None
    """(N, H) image features of the rows' image tokens in row-major order; None for text."""
    layout: Packed
    """The packing before the cp padding (its flat positions count in its own width)."""


class Run(NamedTuple):
    """One micro-batch's samples and their packing (`run_of`), before any tensor goes to the device."""

    sequences: list[Tensor]
    images: list[SampleImages] | None
    prompt_lens: Tensor | None
    layout: Packed


def run_of(sequences: list[Tensor], images: list[SampleImages] | None, prompt_lens: Tensor | None,
           vision_config) -> Run:
    """`sequences` packed as the torch engine packs them (`prompt_lens`: a prompt's samples share
    it, text models only). `vision_config`: a VLM's config, or None."""
    if images is not None and vision_config is None:
        raise ValueError("megatron backend: images given to a text model")
    return Run(sequences, images, prompt_lens, packed_layout(sequences, None, images, prompt_lens))


def common_shape(runs: list[Run], split: ContextSplit) -> tuple[int, int]:
    """(rows, width) that every run's batch fits: megatron's pipeline schedule passes activations
    of one shape between its stages for every micro-batch of a step."""
    return (max(run.layout.input_ids.shape[0] for run in runs),
            split.width(max(run.layout.input_ids.shape[1] for run in runs)))


def packed_batch(run: Run, split: ContextSplit, vision_config, device: torch.device,
                 shape: tuple[int, int] | None = None) -> Batch:
    """`run`'s packed rows, right-padded for `split` (and to at least `shape`, rows and width), on
    `device`; padding rows and columns attend to themselves only."""
    layout = run.layout
    rows, width = layout.input_ids.shape
    extra = max(split.width(width), shape[1] if shape is not None else 0) - width
    more = max(shape[0] - rows, 0) if shape is not None else 0
    attend = torch.eye(width + extra, dtype=torch.bool).repeat(rows + more, 1, 1, 1)  # (R, 1, C, C)
    attend[:rows, :, :width, :width] = layout.attention_mask
    features = None
    if run.images is None:
        positions = layout.position_ids.expand(3, rows, width)
    else:
        positions, features = vision_inputs(layout, run.sequences, run.images, vision_config)
        features = features.to(device)
    return Batch(F.pad(layout.input_ids, (0, extra, 0, more)).to(device),
                 F.pad(positions, (0, extra, 0, more)).to(device), split.take(~attend, 2).to(device), features, layout)


def token_logprobs(hidden: Tensor, head_weight: Tensor, batch: Batch, sequences: list[Tensor], temperature: float,
                   with_entropy: bool, split: ContextSplit) -> tuple[list[Tensor], list[Tensor] | None]:
    """(L_i - 1,) log-probs (and entropies) of `sequences` from the last stage's hidden states
    (R, C_local, H) of `batch` (C_local = C / cp) and the (V, H) output layer's weight."""
    scored = token_scores(hidden, head_weight, batch, sequences, temperature, with_entropy, split)
    lengths = [len(s) - 1 for s in sequences]
    logps = list(scored[:, 0].split(lengths))
    return logps, list(scored[:, 1].split(lengths)) if with_entropy else None


def token_scores(hidden: Tensor, head_weight: Tensor, batch: Batch, sequences: list[Tensor], temperature: float,
                 with_entropy: bool, split: ContextSplit) -> Tensor:
    """`token_logprobs` of all sequences laid end to end: (sum (L_i - 1), 1), with the entropies
    as a second column."""
    device = hidden.device
    positions, labels, inverse = next_token_pairs(batch.layout, sequences, head_weight.shape[0], device)
    width = batch.layout.input_ids.shape[1]
    rows, columns = positions // width, positions % width  # (P,)
    owner, slot = (t.to(device) for t in split.locate(batch.ids.shape[1]))
    mine = owner[columns] == split.rank  # (P,): the pairs whose position this cp rank holds
    if mine.any():
        logp, entropy = logprobs_from_hidden(hidden[rows[mine], slot[columns[mine]]], head_weight, labels[mine],
                                             temperature, with_entropy)
        scored = torch.stack([logp, entropy] if with_entropy else [logp], -1)  # (P_mine, 1 or 2)
    else:  # no pair's position is on this cp rank: no kernel on empty input, the loss still reaches the hidden states
        scored = hidden.new_zeros(0, 1 + with_entropy) + hidden.sum() * 0
    if split.cp > 1:
        scored = split.combine(scored.new_zeros(len(positions), scored.shape[1]).index_put((mine,), scored))
    return scored[inverse] if inverse is not None else scored  # (M, 1 or 2)


def token_values(output: Tensor, batch: Batch, split: ContextSplit) -> list[Tensor]:
    """(L_i - 1,) values of each sequence of `batch` from the critic's (R, C_local) output, position
    t valuing the state before token t + 1."""
    return list(flat_values(output, batch, split).split([n - 1 for n in batch.layout.lengths]))


def flat_values(output: Tensor, batch: Batch, split: ContextSplit) -> Tensor:
    """`token_values` of all sequences laid end to end: (sum (L_i - 1),)."""
    values = split.gather(output)  # (R, C)
    width = batch.layout.input_ids.shape[1]
    flat = values[:, :width].reshape(-1)  # (R * width,): the layout's flat positions
    return flat[batch.layout.predicting().to(flat.device)]
