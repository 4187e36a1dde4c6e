"""Sequence packing: run variable-length sequences through a model without per-sequence padding.

    packed = pack(sequences, capacity=512)           # rows of at most 512 tokens
    logits = packed_forward(model, sequences)        # list of (L_i, V), gradients flow
    logp, ent = sequence_logprobs(model, sequences, temperature=0.7, with_entropy=True)

Sequences are placed into rows of at most `capacity` tokens by first-fit-decreasing bin packing,
so short sequences share a row and attention cost stays bounded by capacity**2 per row; of the
row widths tried, the one with the fewest padded slots wins (the model computes padding too).
Each row gets a block-diagonal causal attention mask (a token attends only to earlier tokens of its own sequence)
and position ids that restart at 0 per sequence; with these, Hugging Face models (sdpa attention)
give the same logits as separate forwards. Padding only fills the tail of each row.

Vision-language models (`images=`, one `SampleImages` per sequence): each row is fed as
`inputs_embeds` (token embeddings with each sequence's precomputed image features at its image
tokens; Qwen3-VL's deepstack features beside them) with M-RoPE position ids (3, R, C) (each
sequence's own, placed at its span; 0 on padding) and the same block-diagonal mask; the vision
tower is never run. Features are constants (no grad).

Shared prompts (`pack_shared`, `prompt_lens=`): the samples of one prompt (GRPO's groups) hold
the prompt once, [prompt, response_1, response_2, ...] in a row, each response attending to the
prompt and to itself, so the model runs every prompt once instead of once per sample. Each
sequence's outputs are gathered back (`Packed.positions`); gradients through the shared prompt add up
as they would over separate copies.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from stream_rlhf.device_copy import to_device
from stream_rlhf.kernels.logprob import logprobs_from_hidden
from stream_rlhf.models.vision_language import (
    check_images,
    decoder_logits,
    language_model_inputs,
    mrope_head,
)
from stream_rlhf.samples import SampleImages

WIDER_ROW_SAVING = 0.125
"""The share of slots a wider row width must save over a narrower one to be chosen."""
MAX_WIDTHS_TRIED = 16
"""Row widths `_fewest_slots` tries (multiples of the longest sequence), besides the capacity."""
SHARED_ROW_FACTOR = 4
"""`pack_shared`'s default row capacity, in longest sequences: a prompt's samples share a row up to
this (GRPO's 4 to 8 samples of short answers fit; long answers split into several copies)."""


@dataclass(frozen=True)
class Packed:
    """Sequences packed into R rows of C tokens (C = the fullest row's length, <= capacity)."""

    input_ids: Tensor
    """(R, C) long; tail of each row filled with pad_id."""
    position_ids: Tensor
    """(R, C) long; each sequence's own positions from 0 (0 on padding)."""
    attention_mask: Tensor
    """(R, 1, C, C) bool, True = attend: a token attends to the earlier tokens of its own sequence
    (a shared prefix included). Padding attends only to itself."""
    positions: Tensor
    """(sum L_i,) long: every input sequence's tokens' flat positions (row * C + column), in order,
    the sequences laid end to end in input order. A prefix shared by several sequences
    (`pack_shared`) is in the rows once and in each of their runs."""
    lengths: list[int]
    """L_i of each input sequence: its run in `positions`."""
    shares_prefixes: bool = False
    """Some positions belong to several sequences (a prefix shared by them)."""

    def predicting(self) -> Tensor:
        """(sum (L_i - 1),) the flat positions that predict a next token: each sequence's run
        without its last token (position t predicts token t + 1), in input order."""
        return self.positions[_all_but_last(self.lengths).to(self.positions.device)]


_NOTHING = torch.empty(0, dtype=torch.long)
"""The rest of a sequence that shares nothing (one tensor for all: no operation per sequence)."""


@dataclass(frozen=True)
class _Unit:
    """What one stretch of a row holds: a prefix, then the rest of each sequence that shares it."""

    prefix: Tensor
    branches: list[tuple[int, Tensor]]
    """(input index, tokens after the prefix) per sequence; the prefix is a whole sequence's when
    its rest is empty."""

    @property
    def length(self) -> int:
        return len(self.prefix) + sum(len(rest) for _, rest in self.branches)

    @classmethod
    def whole(cls, index: int, sequence: Tensor) -> _Unit:
        """A sequence that shares nothing (its rest: `_NOTHING`, left out of the rows' tokens)."""
        return cls(sequence, [(index, _NOTHING)])


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


def _check_lengths(sequences: list[Tensor]) -> list[int]:
    if not sequences:
        raise ValueError("sequences: must not be empty")
    lengths = [int(s.numel()) for s in sequences]
    if min(lengths) < 1:
        raise ValueError(f"sequences[{lengths.index(min(lengths))}] has length 0: must be >= 1")
    return lengths


def pack(sequences: list[Tensor], capacity: int | None = None, pad_id: int = 0) -> Packed:
    """Pack 1-D token sequences (L_i,) into rows of at most `capacity` tokens (default: the longest).

    Tensors are built on the device of the first sequence.
    """
    lengths = _check_lengths(sequences)
    capacity = max(lengths) if capacity is None else capacity
    if capacity < max(lengths):
        raise ValueError(f"capacity={capacity}: must be >= the longest sequence ({max(lengths)})")
    return _lay_out([_Unit.whole(i, seq) for i, seq in enumerate(sequences)], len(sequences), capacity, pad_id)


def pack_shared(sequences: list[Tensor], prefix_lens: Tensor, capacity: int | None = None, pad_id: int = 0) -> Packed:
    """`pack`, with the sequences that begin with the same prefix (the same `prefix_lens[i]`
    tokens: the samples of one prompt) sharing one copy of it: [prefix, rest_1, rest_2, ...] in a
    row, each rest attending to the prefix and to itself, its positions continuing the prefix's.
    The model then runs each shared prefix once; outputs at the prefix are the same as unshared.

    Members of a group are placed together while the row stays within `capacity` (default: four
    times the longest sequence, which bounds the attention cost of a row); the rest start a new copy.
    """
    lengths = _check_lengths(sequences)
    if len(prefix_lens) != len(sequences):
        raise ValueError(f"prefix_lens: {len(prefix_lens)} entries for {len(sequences)} sequences")
    capacity = SHARED_ROW_FACTOR * max(lengths) if capacity is None else capacity
    if capacity < max(lengths):
        raise ValueError(f"capacity={capacity}: must be >= the longest sequence ({max(lengths)})")
    groups: dict[tuple[int, ...], list[int]] = {}  # prefix tokens -> the sequences that start with them
    units: list[_Unit] = []
    for i, (seq, p) in enumerate(zip(sequences, prefix_lens.tolist())):
        if 0 < p < len(seq):
            groups.setdefault(tuple(seq[:p].tolist()), []).append(i)
        else:
            units.append(_Unit.whole(i, seq))
    for key, members in groups.items():
        if len(members) == 1:
            units.append(_Unit.whole(members[0], sequences[members[0]]))
            continue
        prefix = sequences[members[0]][: len(key)]
        unit = _Unit(prefix, [])
        for i in members:
            rest = sequences[i][len(key):]
            if unit.branches and unit.length + len(rest) > capacity:
                units.append(unit)
                unit = _Unit(prefix, [])
            unit.branches.append((i, rest))
        units.append(unit)
    return _lay_out(units, len(sequences), capacity, pad_id)


def _fewest_slots(lengths: list[int], capacity: int) -> list[tuple[int, int]]:
    """First-fit-decreasing placement into the row width, a multiple of the longest length up to
    `capacity`, that leaves the fewest slots (rows x width: the model computes padding too). A
    wider row must save WIDER_ROW_SAVING of the slots: attention grows with the width."""
    longest = max(lengths)
    best: tuple[int, list[tuple[int, int]]] | None = None
    for width in sorted({*range(longest, capacity + 1, longest)[:MAX_WIDTHS_TRIED], capacity}):
        placement = _first_fit_decreasing(lengths, width)
        rows = max(row for row, _ in placement) + 1
        slots = rows * max(start + n for (_, start), n in zip(placement, lengths))
        if best is None or slots < (1 - WIDER_ROW_SAVING) * best[0]:
            best = (slots, placement)
    return best[1]


def _lay_out(units: list[_Unit], count: int, capacity: int, pad_id: int) -> Packed:
    """Rows holding `units` (`_fewest_slots`), the mask and positions that make every sequence see
    exactly its own tokens, and each sequence's token positions. Vectorised: a handful of tensor
    operations over every token, whatever the number of sequences (the slice writes per sequence
    it replaced took 14 ms for 128 sequences on the host of every forward, this 3.7 ms)."""
    pieces = [[len(unit.prefix), *(len(rest) for _, rest in unit.branches)] for unit in units]  # tokens
    lengths = [sum(piece) for piece in pieces]
    placement = _fewest_slots(lengths, capacity)
    n_rows = max(row for row, _ in placement) + 1
    width = max(start + n for (_, start), n in zip(placement, lengths))
    device = units[0].prefix.device
    tokens = torch.cat([t for unit in units for t in (unit.prefix, *(rest for _, rest in unit.branches))
                        if t is not _NOTHING])
    piece_lengths = torch.tensor([n for piece in pieces for n in piece])  # a unit's prefix, then each rest
    piece_unit = torch.repeat_interleave(torch.arange(len(units)), torch.tensor([len(piece) for piece in pieces]))
    piece_branch = torch.tensor([b for piece in pieces for b in range(len(piece))])  # 0 = the prefix
    piece_position = torch.tensor([0 if b == 0 else piece[0] for piece in pieces for b in range(len(piece))])
    unit_flat = torch.tensor([row * width + start for row, start in placement])  # where each unit begins
    unit_lengths = torch.tensor(lengths)
    flat = torch.repeat_interleave(unit_flat, unit_lengths) + _offsets(unit_lengths)  # (N,) row * C + column
    input_ids = torch.full((n_rows * width,), pad_id, dtype=torch.long)
    input_ids[flat] = tokens.cpu().long()
    position_ids = torch.zeros(n_rows * width, dtype=torch.long)
    position_ids[flat] = torch.repeat_interleave(piece_position, piece_lengths) + _offsets(piece_lengths)
    segment = torch.full((n_rows * width,), -1, dtype=torch.long)  # -1 = padding
    segment[flat] = torch.repeat_interleave(piece_unit, piece_lengths)
    branch = torch.zeros(n_rows * width, dtype=torch.long)  # 0 = the prefix
    branch[flat] = torch.repeat_interleave(piece_branch, piece_lengths)
    runs = [(0, 0, 0, 0)] * count  # per sequence: where its prefix and its rest lie in `flat`, and their lengths
    at = 0
    for unit, piece in zip(units, pieces):
        offset = at + piece[0]
        for (i, _), n in zip(unit.branches, piece[1:]):
            runs[i] = (at, piece[0], offset, n)
            offset += n
        at = offset
    run_starts = torch.tensor([start for prefix_at, _, rest_at, _ in runs for start in (prefix_at, rest_at)])
    run_lengths = torch.tensor([length for _, prefix, _, rest in runs for length in (prefix, rest)])
    positions = to_device(flat[torch.repeat_interleave(run_starts, run_lengths) + _offsets(run_lengths)], device)
    input_ids, position_ids, segment, branch = (to_device(t.view(n_rows, width), device)
                                                for t in (input_ids, position_ids, segment, branch))
    causal = torch.ones(width, width, dtype=torch.bool, device=device).tril()  # (C, C)
    same = (segment[:, :, None] == segment[:, None, :]) & (segment != -1)[:, :, None]  # (R, C, C)
    visible = (branch[:, None, :] == 0) | (branch[:, :, None] == branch[:, None, :])  # key in the prefix or own rest
    # padding attends to itself so no query row is fully masked (which would give NaN under sdpa)
    mask = (same & causal & visible) | torch.eye(width, dtype=torch.bool, device=device)  # (R, C, C)
    shares = any(len(unit.branches) > 1 for unit in units)
    return Packed(input_ids, position_ids, mask[:, None], positions, [p + n for _, p, _, n in runs], shares)


def _all_but_last(lengths: list[int]) -> Tensor:
    """(sum(lengths),) bool: False at the last element of each run, for runs laid end to end."""
    keep = torch.ones(sum(lengths), dtype=torch.bool)
    keep[torch.cumsum(torch.tensor(lengths), 0) - 1] = False
    return keep


def _starts(lengths: Tensor) -> Tensor:
    """Where each run begins, for runs of `lengths` laid end to end."""
    return torch.cumsum(lengths, 0) - lengths


def _offsets(lengths: Tensor) -> Tensor:
    """Each element's offset within its run, for runs of `lengths` laid end to end: (sum(lengths),)."""
    return torch.arange(int(lengths.sum())) - torch.repeat_interleave(_starts(lengths), lengths)


def unpack(values: Tensor, packed: Packed) -> list[Tensor]:
    """Per-token values (R, C, ...) -> one (L_i, ...) tensor per input sequence, in input order:
    views into one gather of every sequence's positions."""
    flat = values.reshape(-1, *values.shape[2:])  # (R * C, ...)
    return list(flat[to_device(packed.positions, flat.device)].split(packed.lengths))


def vision_inputs(packed: Packed, sequences: list[Tensor], images: list[SampleImages],
                  config) -> tuple[Tensor, Tensor]:
    """A vision-language model's packed inputs besides the tokens: M-RoPE positions (3, R, C), each
    sequence's own at its span (0 on padding), and the (N, W) image features in row-major order of
    the packed image tokens. `config`: the VLM's."""
    if len(images) != len(sequences):
        raise ValueError(f"images: {len(images)} entries for {len(sequences)} sequences: must be one per sequence")
    check_images(sequences, images, config)
    n_rows, width = packed.input_ids.shape
    parts = [mrope_head(seq, sample.grid_thw, config) for seq, sample in zip(sequences, images)]  # (cached)
    heads, currents, texts = zip(*parts)
    lengths, texts = torch.tensor(packed.lengths), torch.tensor(texts)
    flat = packed.positions.cpu()
    in_head = _offsets(lengths) < torch.repeat_interleave(lengths - texts, lengths)  # each token, in input order
    position_ids = torch.zeros((3, n_rows * width), dtype=torch.long)  # (3, R * C): `mrope_positions` at each span
    position_ids[:, flat[in_head]] = torch.cat(heads, dim=1)
    position_ids[:, flat[~in_head]] = torch.repeat_interleave(torch.tensor(currents), texts) + _offsets(texts)
    # features in row-major order of the packed image tokens: by each sequence's first position
    firsts = flat[_starts(lengths)]
    order = torch.argsort(firsts).tolist()
    return position_ids.view(3, n_rows, width), torch.cat([images[i].features for i in order])  # (N, W)


def _model_inputs(
    model: nn.Module, packed: Packed, sequences: list[Tensor], images: list[SampleImages] | None, device: torch.device
) -> dict[str, Tensor | list[Tensor]]:
    """Keyword inputs of a packed forward: input_ids and (R, C) positions for a text model;
    `language_model_inputs` (inputs_embeds (R, C, H) with the image features scattered in) and
    (3, R, C) M-RoPE positions with images."""
    mask = to_device(packed.attention_mask, device)
    if images is None:
        return {
            "input_ids": to_device(packed.input_ids, device),
            "position_ids": to_device(packed.position_ids, device),
            "attention_mask": mask,
        }
    position_ids, features = vision_inputs(packed, sequences, images, model.config)
    inputs = language_model_inputs(model, packed.input_ids, to_device(features, device))  # (ids: counted on the host)
    return {**inputs, "position_ids": to_device(position_ids, device), "attention_mask": mask}


def shared_prompt_lens(prompt_lens: Tensor | None, images: list[SampleImages] | None) -> Tensor | None:
    """The prompt lengths by which a forward's samples share their prompts: `prompt_lens` for a
    text model, None with images (a vision-language model's M-RoPE positions are placed per whole
    sequence)."""
    return prompt_lens if images is None else None


def packed_layout(sequences: list[Tensor], capacity: int | None, images: list[SampleImages] | None,
                  prompt_lens: Tensor | None) -> Packed:
    """The layout of a forward: prompts shared by their samples as `shared_prompt_lens` says."""
    shared = shared_prompt_lens(prompt_lens, images)
    return pack(sequences, capacity) if shared is None else pack_shared(sequences, shared, capacity)


def packed_forward(
    model: nn.Module,
    sequences: list[Tensor],
    capacity: int | None = None,
    images: list[SampleImages] | None = None,
    prompt_lens: Tensor | None = None,
) -> list[Tensor]:
    """`model(...).logits` of each sequence (L_i,) as (L_i, ...), computed packed; gradients flow.

    (L_i, V) for a causal LM, (L_i, 1) for a token-classification value or reward head. `images`:
    one `SampleImages` per sequence for a vision-language model (None: a text model).
    `prompt_lens` (N,): the samples of one prompt share its forward (`pack_shared`).
    """
    packed = packed_layout(sequences, capacity, images, prompt_lens)
    return unpack(packed_outputs(model, packed, sequences, images), packed)


def packed_outputs(model: nn.Module, packed: Packed, sequences: list[Tensor],
                   images: list[SampleImages] | None) -> Tensor:
    """`model(...).logits` of the packed rows, (R, C, ...) (`packed_forward` unpacks them)."""
    device = next(model.parameters()).device
    inputs = _model_inputs(model, packed, sequences, images, device)
    lm_head = getattr(model, "get_output_embeddings", lambda: None)()
    if images is not None and lm_head is not None:  # a whole VLM, not its critic
        return decoder_logits(model, **inputs)  # (R, C, V)
    return model(**inputs).logits


def packed_hidden_states(
    model: nn.Module, sequences: list[Tensor], capacity: int | None = None, images: list[SampleImages] | None = None
) -> list[Tensor]:
    """The decoder's last hidden states (what the LM head reads) of each sequence, (L_i, H)."""
    packed = pack(sequences, capacity)
    device = model.get_output_embeddings().weight.device
    hidden = model.get_decoder()(**_model_inputs(model, packed, sequences, images, device)).last_hidden_state
    return unpack(hidden, packed)


def next_token_pairs(packed: Packed, sequences: list[Tensor], vocab: int,
                     device: torch.device) -> tuple[Tensor, Tensor, Tensor | None]:
    """What a packed forward's log-probs are of: flat positions (row * C + column) (P,) and the
    next tokens they predict (P,), each pair once, and `inverse` (M,) taking them back to every
    sequence's (L_i - 1,) in input order (None when nothing is shared: P = M, in that order)."""
    positions = packed.predicting()  # (M,): position t predicts t + 1
    tokens = torch.cat(sequences).long()
    # (M,): the token after each one but a sequence's last
    labels = tokens.roll(-1)[_all_but_last(packed.lengths).to(tokens.device)]
    if packed.shares_prefixes:  # where the sequences are (the host, for a train step): no wait for the device
        pairs, inverse = torch.unique(positions * vocab + labels, return_inverse=True)  # each pair once
        positions, labels, inverse = pairs // vocab, pairs % vocab, to_device(inverse, device)
    else:
        inverse = None
    return to_device(positions, device), to_device(labels, device), inverse


def sequence_logprobs(
    model: nn.Module,
    sequences: list[Tensor],
    temperature: float,
    with_entropy: bool = False,
    capacity: int | None = None,
    images: list[SampleImages] | None = None,
    prompt_lens: Tensor | None = None,
) -> tuple[list[Tensor], list[Tensor] | None]:
    """log p(token t+1 | tokens <= t) of each sequence (L_i,) as (L_i - 1,), and optionally the
    entropy of each of those next-token distributions (L_i - 1,); fp32, gradients flow.

    Runs the model's decoder to hidden states and hands them with the LM-head weight to the fused
    kernel (`stream_rlhf.kernels.logprob.logprobs_from_hidden`): the (tokens, vocabulary) logits
    are never materialised, on Triton or on the chunked torch path. `images` and `prompt_lens` as
    in `packed_forward`; with a shared prompt, each (position, next token) pair is computed once.
    """
    logp, entropy = pair_logprobs(model, sequences, temperature, with_entropy, capacity, images, prompt_lens)
    lengths = [len(seq) - 1 for seq in sequences]
    return list(logp.split(lengths)), list(entropy.split(lengths)) if with_entropy else None


def pair_logprobs(model: nn.Module, sequences: list[Tensor], temperature: float, with_entropy: bool,
                  capacity: int | None, images: list[SampleImages] | None,
                  prompt_lens: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """`sequence_logprobs` of all sequences laid end to end, (sum (L_i - 1),) each (`sequence_logprobs`
    splits them)."""
    packed = packed_layout(sequences, capacity, images, prompt_lens)
    head = model.get_output_embeddings()
    if getattr(head, "bias", None) is not None:
        raise ValueError(f"{type(model).__name__}: an LM head with a bias is not supported by the fused log-probs")
    device = head.weight.device
    inputs = _model_inputs(model, packed, sequences, images, device)
    hidden = model.get_decoder()(**inputs).last_hidden_state  # (R, C, H)
    positions, labels, inverse = next_token_pairs(packed, sequences, head.weight.shape[0], device)
    flat = hidden.reshape(-1, hidden.shape[-1])  # (R * C, H)
    logp, entropy = logprobs_from_hidden(flat[positions], head.weight, labels, temperature, with_entropy)
    if inverse is not None:
        logp, entropy = logp[inverse], entropy[inverse] if with_entropy else None
    return logp, entropy
