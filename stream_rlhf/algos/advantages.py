"""Advantage estimators, one uniform signature, chosen by name from `ADVANTAGE_ESTIMATORS`.

    fn(token_rewards (B, T), mask (B, T), values (B, T) | None, group_ids (B,) long, gamma, lam)
        -> (advantages (B, T), returns (B, T))

`mask` marks the valid (response) tokens of each row; it may have leading zeros (prompt) and
trailing zeros (padding). Rewards and values at masked-out positions are ignored, and both outputs
are 0 there. "Next token" always means the next *valid* position in the row. `group_ids` says which
rows are samples for the same prompt (used by grpo and rloo); a row without a valid token (an
episode masked out: env.failed_episodes) is no member of its group. Each estimator ignores the
inputs it does not need; only those in `NEEDS_CRITIC` use `values`. The outputs are targets:
computed without gradient.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

GROUP_STD_EPS = 1e-6


@torch.no_grad()
def gae(
    token_rewards: Tensor, mask: Tensor, values: Tensor | None, group_ids: Tensor, gamma: float, lam: float
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation (PPO with a critic).

    delta_t = r_t + gamma * V_next - V_t and A_t = delta_t + gamma * lam * A_next, where next is the
    next valid position of the row (V_next = 0, A_next = 0 after the last one). returns = A + V.
    """
    if values is None:
        raise ValueError("gae needs values from a critic; got values=None")
    valid = mask.bool()
    advantages = torch.zeros_like(token_rewards)
    next_value = torch.zeros_like(token_rewards[:, 0])  # (B,)
    next_advantage = torch.zeros_like(next_value)  # (B,)
    for t in reversed(range(token_rewards.shape[1])):
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        advantage = delta + gamma * lam * next_advantage
        advantages[:, t] = torch.where(valid[:, t], advantage, 0.0)
        next_advantage = torch.where(valid[:, t], advantage, next_advantage)
        next_value = torch.where(valid[:, t], values[:, t], next_value)
    returns = torch.where(valid, advantages + values, 0.0)
    return advantages, returns


def _row_scores(token_rewards: Tensor, mask: Tensor) -> Tensor:
    """Sum of the valid token rewards of each row: (B, T) -> (B,)."""
    return torch.where(mask.bool(), token_rewards, 0.0).sum(dim=-1)


def _group_sum_and_size(scores: Tensor, group_ids: Tensor, members: Tensor) -> tuple[Tensor, Tensor]:
    """For each row, the sum of the scores of its group's members and their number: (B,) -> (B,),
    (B,); `members` (B,) bool: the rows that count."""
    _, group_index = torch.unique(group_ids, return_inverse=True)  # (B,) in [0, num_groups)
    num_groups = int(group_index.max()) + 1
    kept = torch.where(members, scores, 0.0)
    sums = torch.zeros(num_groups, dtype=scores.dtype, device=scores.device).index_add_(0, group_index, kept)
    sizes = torch.zeros(num_groups, dtype=scores.dtype, device=scores.device).index_add_(
        0, group_index, members.to(scores.dtype))
    return sums[group_index], sizes[group_index]


def _broadcast(row_advantages: Tensor, mask: Tensor) -> Tensor:
    """One advantage per row (B,) onto the row's valid tokens (B, T), 0 elsewhere."""
    return torch.where(mask.bool(), row_advantages[:, None], 0.0)


@torch.no_grad()
def grpo(
    token_rewards: Tensor, mask: Tensor, values: Tensor | None, group_ids: Tensor, gamma: float, lam: float,
    scale: bool = True,
) -> tuple[Tensor, Tensor]:
    """GRPO: score_i = sum_t r_it over valid tokens; A_i = (score_i - mean_g) / (std_g + 1e-6) with
    the group's mean and *population* std (unbiased=False), broadcast over row i's valid tokens;
    with `scale` false A_i = score_i - mean_g (Dr. GRPO, `algorithm.group_std`). A group of one has
    score == mean, so advantage 0. returns = advantages. values, gamma, lam unused."""
    scores = _row_scores(token_rewards, mask)  # (B,)
    members = mask.bool().any(dim=-1)
    sums, sizes = _group_sum_and_size(scores, group_ids, members)
    sizes = sizes.clamp(min=1)  # a group with no member: its rows have no valid token either
    centered = scores - sums / sizes
    if not scale:
        advantages = _broadcast(centered, mask)
        return advantages, advantages.clone()
    variance_sums, _ = _group_sum_and_size(centered**2, group_ids, members)
    std = torch.sqrt(variance_sums / sizes)
    advantages = _broadcast(centered / (std + GROUP_STD_EPS), mask)
    return advantages, advantages.clone()


@torch.no_grad()
def rloo(
    token_rewards: Tensor, mask: Tensor, values: Tensor | None, group_ids: Tensor, gamma: float, lam: float
) -> tuple[Tensor, Tensor]:
    """REINFORCE leave-one-out: A_i = score_i - mean of the *other* members' scores in its group
    (score as in grpo), broadcast over row i's valid tokens; a group of one gets 0.
    returns = advantages. values, gamma, lam unused."""
    scores = _row_scores(token_rewards, mask)  # (B,)
    sums, sizes = _group_sum_and_size(scores, group_ids, mask.bool().any(dim=-1))
    others_mean = (sums - scores) / (sizes - 1).clamp(min=1)
    row_advantages = torch.where(sizes > 1, scores - others_mean, 0.0)
    advantages = _broadcast(row_advantages, mask)
    return advantages, advantages.clone()


@torch.no_grad()
def reinforce_pp(
    token_rewards: Tensor, mask: Tensor, values: Tensor | None, group_ids: Tensor, gamma: float, lam: float
) -> tuple[Tensor, Tensor]:
    """REINFORCE++ (no critic): G_t = r_t + gamma * G_next over valid tokens (G after the last valid
    token = 0); advantages = returns = G. The global whitening over the whole batch that REINFORCE++
    applies to these advantages is the caller's job (`masked_whiten`), since it may span several
    calls. values, group_ids, lam unused."""
    valid = mask.bool()
    returns = torch.zeros_like(token_rewards)
    next_return = torch.zeros_like(token_rewards[:, 0])  # (B,)
    for t in reversed(range(token_rewards.shape[1])):
        ret = token_rewards[:, t] + gamma * next_return
        returns[:, t] = torch.where(valid[:, t], ret, 0.0)
        next_return = torch.where(valid[:, t], ret, next_return)
    return returns.clone(), returns


AdvantageEstimator = Callable[[Tensor, Tensor, Tensor | None, Tensor, float, float], tuple[Tensor, Tensor]]

ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimator] = {
    "gae": gae,
    "grpo": grpo,
    "rloo": rloo,
    "reinforce_pp": reinforce_pp,
}

NEEDS_CRITIC = {"gae"}
