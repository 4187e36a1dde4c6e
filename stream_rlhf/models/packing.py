"""Sequence packing: run variable-length sequences through a model without per-sequence padding.

    packed = pack(sequences, capacity=512)           # rows of at most 512 tokens
    logits = packed_forward(model, sequences)        # list of (L_i, V), gradients flow
    logp, ent = sequence_logprobs(model, sequences, temperature=0.7, with_entropy=True)

Sequences are placed into rows of `capacity` tokens by first-fit-decreasing bin packing, so short
sequences share a row and attention cost stays bounded by capacity**2 per row. Each row gets a
block-diagonal causal attention mask (a token attends only to earlier tokens of its own sequence)
and position ids that restart at 0 per sequence; with these, Hugging Face models (sdpa attention)
give the same logits as separate forwards. Padding only fills the tail of each row.

Vision-language models (`images=`, one `SampleImages` per sequence): each row is fed as
`inputs_embeds` (token embeddings with each sequence's precomputed image features at its image
tokens) with M-RoPE position ids (3, R, C) (each sequence's own, placed at its span; 0 on padding)
and the same block-diagonal mask; the vision tower is never run. Features are constants (no grad).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor, nn

from stream_rlhf.kernels.logprob import logprobs_from_hidden
from stream_rlhf.models.vision_language import SampleImages, check_sample_images, embed_with_images, mrope_positions


@dataclass(frozen=True)
class Packed:
    """Sequences packed into R rows of C tokens (C = the fullest row's length, <= capacity)."""

    input_ids: Tensor
    """(R, C) long; tail of each row filled with pad_id."""
    position_ids: Tensor
    """(R, C) long; restarts at 0 at the start of every sequence (0 on padding)."""
    attention_mask: Tensor
    """(R, 1, C, C) bool, True = attend; block-diagonal causal. Padding attends only to itself."""
    spans: list[tuple[int, int, int]]
    """(row, start, length) of each input sequence, in input order."""


def _first_fit_decreasing(lengths: list[int], capacity: int) -> list[tuple[int, int]]:
    """(row, start) of each length, placing longest first into the first row with room."""
    fill: list[int] = []  # tokens used per row
    placement: list[tuple[int, int]] = [(0, 0)] * len(lengths)
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        row = next((r for r, used in enumerate(fill) if used + lengths[i] <= capacity), len(fill))
        if row == len(fill):
            fill.append(0)
        placement[i] = (row, fill[row])
        fill[row] += lengths[i]
    return placement


def pack(sequences: list[Tensor], capacity: int | None = None, pad_id: int = 0) -> Packed:
    """Pack 1-D token sequences (L_i,) into rows of at most `capacity` tokens (default: the longest).

    Tensors are built on the device of the first sequence.
    """
    if not sequences:
        raise ValueError("sequences: must not be empty")
    lengths = [int(s.numel()) for s in sequences]
    if min(lengths) < 1:
        raise ValueError(f"sequences[{lengths.index(min(lengths))}] has length 0: must be >= 1")
    capacity = max(lengths) if capacity is None else capacity
    if capacity < max(lengths):
        raise ValueError(f"capacity={capacity}: must be >= the longest sequence ({max(lengths)})")

    placement = _first_fit_decreasing(lengths, capacity)
    spans = [(row, start, length) for (row, start), length in zip(placement, lengths)]
    n_rows = max(row for row, _ in placement) + 1
    width = max(start + length for _, start, length in spans)
    device = sequences[0].device

    input_ids = torch.full((n_rows, width), pad_id, dtype=torch.long, device=device)  # (R, C)
    position_ids = torch.zeros((n_rows, width), dtype=torch.long, device=device)  # (R, C)
    segment = torch.full((n_rows, width), -1, dtype=torch.long, device=device)  # (R, C), -1 = padding
    for i, (seq, (row, start, length)) in enumerate(zip(sequences, spans)):
        input_ids[row, start : start + length] = seq.to(device=device, dtype=torch.long)
        position_ids[row, start : start + length] = torch.arange(length, device=device)
        segment[row, start : start + length] = i

    causal = torch.ones(width, width, dtype=torch.bool, device=device).tril()  # (C, C)
    same = (segment[:, :, None] == segment[:, None, :]) & (segment != -1)[:, :, None]  # (R, C, C)
    # padding attends to itself so no query row is fully masked (which would give NaN under sdpa)
    mask = (same & causal) | torch.eye(width, dtype=torch.bool, device=device)  # (R, C, C)
    return Packed(input_ids, position_ids, mask[:, None], spans)


def unpack(values: Tensor, packed: Packed) -> list[Tensor]:
    """Per-token values (R, C, ...) -> one (L_i, ...) tensor per input sequence, in input order."""
    return [values[row, start : start + length] for row, start, length in packed.spans]


def pad_right(seqs: list[Tensor], value: float) -> Tensor:
    """Stack (L_i, ...) tensors into (B, Lmax, ...), filling the tail of each with `value`."""
    return nn.utils.rnn.pad_sequence(seqs, batch_first=True, padding_value=value)


def _model_inputs(
    model: nn.Module, packed: Packed, sequences: list[Tensor], images: list[SampleImages] | None, device: torch.device
) -> dict[str, Tensor]:
    """Keyword inputs of a packed forward: input_ids and (R, C) positions for a text model;
    inputs_embeds (R, C, H) with the image features scattered in and (3, R, C) M-RoPE positions with images."""
    mask = packed.attention_mask.to(device)
    if images is None:
        return {
            "input_ids": packed.input_ids.to(device),
            "position_ids": packed.position_ids.to(device),
            "attention_mask": mask,
        }
    if len(images) != len(sequences):
        raise ValueError(f"images: {len(images)} entries for {len(sequences)} sequences: must be one per sequence")
    config = model.config
    n_rows, width = packed.input_ids.shape
    position_ids = torch.zeros((3, n_rows, width), dtype=torch.long)  # (3, R, C)
    for i, (seq, sample, (row, start, length)) in enumerate(zip(sequences, images, packed.spans)):
        check_sample_images(i, seq, sample, config)
        position_ids[:, row, start : start + length] = mrope_positions(seq.cpu(), sample.grid_thw, config)
    # features in row-major order of the packed image tokens: by row, then by start within the row
    order = sorted(range(len(sequences)), key=lambda i: packed.spans[i][:2])
    features = torch.cat([images[i].features.to(device) for i in order])  # (N, H)
    inputs_embeds = embed_with_images(model, packed.input_ids.to(device), features)  # (R, C, H)
    return {"inputs_embeds": inputs_embeds, "position_ids": position_ids.to(device), "attention_mask": mask}


def packed_forward(
    model: nn.Module,
    sequences: list[Tensor],
    capacity: int | None = None,
    images: list[SampleImages] | None = None,
) -> list[Tensor]:
    """`model(...).logits` of each sequence (L_i,) as (L_i, ...), computed packed; gradients flow.

    (L_i, V) for a causal LM, (L_i, 1) for a token-classification value or reward head. `images`:
    one `SampleImages` per sequence for a vision-language model (None: a text model).
    """
    packed = pack(sequences, capacity)
    device = next(model.parameters()).device
    logits = model(**_model_inputs(model, packed, sequences, images, device)).logits  # (R, C, ...)
    return unpack(logits, packed)


def packed_hidden_states(
    model: nn.Module, sequences: list[Tensor], capacity: int | None = None, images: list[SampleImages] | None = None
) -> list[Tensor]:
    """The decoder's last hidden states (what the LM head reads) of each sequence, (L_i, H)."""
    packed = pack(sequences, capacity)
    device = model.get_output_embeddings().weight.device
    hidden = model.get_decoder()(**_model_inputs(model, packed, sequences, images, device)).last_hidden_state
    return unpack(hidden, packed)


def sequence_logprobs(
    model: nn.Module,
    sequences: list[Tensor],
    temperature: float,
    with_entropy: bool = False,
    capacity: int | None = None,
    images: list[SampleImages] | None = None,
) -> tuple[list[Tensor], list[Tensor] | None]:
    """log p(token t+1 | tokens <= t) of each sequence (L_i,) as (L_i - 1,), and optionally the
    entropy of each of those next-token distributions (L_i - 1,); fp32, gradients flow.

    Runs the model's decoder to hidden states and hands them with the LM-head weight to the fused
    kernel (`stream_rlhf.kernels.logprob.logprobs_from_hidden`): the (tokens, vocabulary) logits
    are never materialised, on Triton or on the chunked torch path. `images` as in `packed_forward`.
    """
    packed = pack(sequences, capacity)
    head = model.get_output_embeddings()
    if getattr(head, "bias", None) is not None:
        raise ValueError(f"{type(model).__name__}: an LM head with a bias is not supported by the fused log-probs")
    device = head.weight.device
    inputs = _model_inputs(model, packed, sequences, images, device)
    hidden = model.get_decoder()(**inputs).last_hidden_state[:, :-1]  # (R, C - 1, H): position t predicts t + 1
    labels = packed.input_ids[:, 1:].to(device)  # (R, C - 1)
    logp, entropy = logprobs_from_hidden(hidden, head.weight, labels, temperature, with_entropy)  # (R, C - 1)
    shifted = replace(packed, spans=[(row, start, length - 1) for row, start, length in packed.spans])
    return unpack(logp, shifted), unpack(entropy, shifted) if with_entropy else None
