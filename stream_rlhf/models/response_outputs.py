"""A loss's per-token inputs from a packed forward: the outputs at the positions that predict each
response token, as (N, W) tensors zero after each response, in one gather.

    logp, entropy = response_logprobs(model, sequences, 0.7, prompt_lens, width, with_entropy=True)
    values = response_outputs(critic, sequences, prompt_lens, width)[..., 0]

The same numbers as slicing each sequence's outputs and padding them (`samples.response_slices`,
`Experience.padded`), without the operations per sequence that path runs in the forward and, as
autograd nodes, in the backward: on a GPU each of them is a kernel launch (`bench/train_step.py`).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from stream_rlhf.device_copy import to_device
from stream_rlhf.models.packing import packed_layout, packed_outputs, pair_logprobs
from stream_rlhf.samples import SampleImages


def response_outputs(model: nn.Module, sequences: list[Tensor], prompt_lens: Tensor, width: int,
                     images: list[SampleImages] | None = None) -> Tensor:
    """`packed_forward`'s outputs at the positions predicting each response token (a value head's:
    the value of the state before it), (N, width, ...), zero after each response: one gather over
    the packed outputs, whatever the number of sequences (`padded_responses`)."""
    packed = packed_layout(sequences, None, images, prompt_lens)
    outputs = packed_outputs(model, packed, sequences, images)  # (R, C, ...)
    flat = outputs.reshape(-1, *outputs.shape[2:])
    per_position = flat[to_device(packed.predicting(), flat.device)]  # (sum (L_i - 1), ...)
    return padded_responses(per_position, [n - 1 for n in packed.lengths], prompt_lens, width)


def response_logprobs(model: nn.Module, sequences: list[Tensor], temperature: float, prompt_lens: Tensor, width: int,
                      with_entropy: bool = False,
                      images: list[SampleImages] | None = None) -> tuple[Tensor, Tensor | None]:
    """`sequence_logprobs` of each response token, (N, width), zero after each response
    (`padded_responses`): a loss's log-probs without an operation per sequence."""
    logp, entropy = pair_logprobs(model, sequences, temperature, with_entropy, None, images, prompt_lens)
    counts = [len(seq) - 1 for seq in sequences]
    return (padded_responses(logp, counts, prompt_lens, width),
            padded_responses(entropy, counts, prompt_lens, width) if with_entropy else None)


def padded_responses(per_position: Tensor, counts: list[int], prompt_lens: Tensor, width: int) -> Tensor:
    """(N, width, ...) from per-position values of N sequences laid end to end ((sum counts, ...),
    sequence i's counts[i] = L_i - 1 positions, position t predicting token t + 1): the values at
    the positions predicting each response token (from prompt_lens[i] - 1 on), left-aligned, 0
    after. One gather on the values' device (the index is built on the host): what
    `Experience.padded(response_slices(...))` gives from per-sequence tensors, without an
    operation per sequence."""
    counts_t = torch.tensor(counts)
    prompt_lens = prompt_lens.cpu().long()
    steps = torch.arange(width)
    valid = steps < (counts_t + 1 - prompt_lens)[:, None]  # (N, width): a response of L_i - P_i tokens
    index = torch.where(valid, (torch.cumsum(counts_t, 0) - counts_t + prompt_lens - 1)[:, None] + steps, 0)
    if not len(per_position):  # no position at all: nothing to gather
        return per_position.new_zeros(len(counts), width, *per_position.shape[1:])
    device = per_position.device
    valid = to_device(valid, device).view(*valid.shape, *([1] * (per_position.ndim - 1)))
    return torch.where(valid, per_position[to_device(index, device)], 0)
