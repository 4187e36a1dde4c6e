"""Process rewards: where a response's steps end, and their scores placed on those tokens.

    ends = step_ends(response_ids, separator_id)        # (S,) positions in the response
    rewards = place_step_rewards(scores, ends, length)  # (R,): scores[k] at ends[k], 0 elsewhere

A response is cut into steps by a separator token. Each separator token ends a step (the step
is the tokens before it, back to the previous separator); the tokens after the last separator,
if any (an end-of-sequence token alone counts), are the final step, which ends at the response's
last token: where the outcome reward sits too. So "19,49<eos>" (separator ",") has two steps,
"19" ending at 2 and "49" ending at 5; "19,<eos>" has "19" and an empty final step at 3; a
response cut off right after a separator ("19,") has one. In an episode (`policy`: the loss mask,
True on policy tokens) only policy tokens are steps: a separator ends a step only where the
policy wrote it, and each policy turn's last token ends one too, so no step spans an
observation. These are pure tensor functions; the scorers live in `stages/process_reward.py`.
"""

from __future__ import annotations

import torch
from torch import Tensor


def step_ends(response_ids: Tensor, separator_id: int, policy: Tensor | None = None) -> Tensor:
    """(S,) long: the position of the token that ends each step of the response (R,); `policy`
    (R,) bool: an episode's policy tokens (None: every token is the policy's)."""
    if policy is None:
        policy = torch.ones_like(response_ids, dtype=torch.bool)
    policy = policy.bool()
    last_of_run = policy & ~torch.cat([policy[1:], policy.new_zeros(1)])  # a turn's (or the response's) last token
    return torch.nonzero(((response_ids == separator_id) & policy) | last_of_run).flatten().long()


def step_spans(response_ids: Tensor, ends: Tensor, separator_id: int,
               policy: Tensor | None = None) -> list[tuple[int, int]]:
    """[start, stop) of each step's own tokens in the response (R,): its ending separator left
    out, the observation tokens before it (`policy` False) too; the final step of a turn keeps its
    last token (decode it without special tokens)."""
    spans, start = [], 0
    for end in ends.tolist():
        while policy is not None and start < end and not bool(policy[start]):
            start += 1
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
