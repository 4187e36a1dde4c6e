"""Process rewards: where a response's steps end, and their scores placed on those tokens.

    ends = step_ends(response_ids, separator_id)        # (S,) positions in the response
    rewards = place_step_rewards(scores, ends, length)  # (R,): scores[k] at ends[k], 0 elsewhere

A response is cut into steps by a separator token. Each separator token ends a step (the step
is the tokens before it, back to the previous separator); the tokens after the last separator,
if any (an end-of-sequence token alone counts), are the final step, which ends at the response's
last token: where the outcome reward sits too. So "19,49<eos>" (separator ",") has two steps,
"19" ending at 2 and "49" ending at 5; "19,<eos>" has "19" and an empty final step at 3; a
response cut off right after a separator ("19,") has one. These are pure tensor functions; the
scorers live in `stages/process_reward.py`.
"""

from __future__ import annotations

import torch
from torch import Tensor


def step_ends(response_ids: Tensor, separator_id: int) -> Tensor:
    """(S,) long: the position of the token that ends each step of the response (R,)."""
    length = response_ids.shape[0]
    ends = torch.nonzero(response_ids == separator_id).flatten()
    if length and (ends.numel() == 0 or int(ends[-1]) != length - 1):
        ends = torch.cat([ends, torch.tensor([length - 1])])
    return ends.long()


def step_spans(response_ids: Tensor, ends: Tensor, separator_id: int) -> list[tuple[int, int]]:
    """[start, stop) of each step's own tokens in the response (R,): its ending separator left
    out; the final step keeps its last token (decode it without special tokens)."""
    spans, start = [], 0
    for end in ends.tolist():
        stop = end if int(response_ids[end]) == separator_id else end + 1
        spans.append((start, stop))
        start = end + 1
    return spans


def place_step_rewards(scores: Tensor, ends: Tensor, length: int) -> Tensor:
    """(R,) float: `scores` (S,) at the positions `ends` (S,) of a response of `length` tokens."""
    if scores.shape != ends.shape:
        raise ValueError(f"{scores.shape[0]} step scores for {ends.shape[0]} steps")
    rewards = torch.zeros(length)
    rewards[ends] = scores.float()
    return rewards
