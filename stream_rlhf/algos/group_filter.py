"""DAPO's dynamic sampling (`algorithm.dynamic_sampling`): which of an iteration's groups train.

    chosen = choose_groups(exp.sample_returns(), exp.group_ids, keep=24)
    trained = exp.select(chosen.index)       # the first 24 groups whose returns differ, in order
    chosen.uniform, chosen.surplus           # samples left out: groups of equal returns, groups past 24
    chosen.reasons                           # per sample: None (trains), UNIFORM or SURPLUS

A group (a prompt's samples) whose returns are all equal has a zero group-relative advantage on
every sample (GRPO, RLOO, Dr. GRPO): it gives the policy no gradient, yet its tokens dilute the
loss's mean and still carry KL and entropy terms. Such groups are left out of training; with
`keep` the first `keep` informative groups train and the later ones are left out as surplus, so
each iteration trains the same number of groups when rollout over-samples (DAPO trains a fixed
batch of informative groups; verl's `filter_groups`). Groups come in the order of their first
sample, which is the mini-batches' order: the choice is the same on every run of a seed.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

UNIFORM = "group returns all equal"
SURPLUS = "surplus group"
"""Why a sample is left out (`ChosenGroups.reasons`)."""


class ChosenGroups(NamedTuple):
    index: Tensor
    """(M,) long: the samples that train, in their order."""
    groups: int
    """Groups that train."""
    short: int
    """Informative groups missing to reach `keep` (0 without `keep`)."""
    reasons: list[str | None]
    """(N,) why each sample is left out: UNIFORM, SURPLUS, or None when it trains."""

    @property
    def uniform(self) -> int:
        """Samples left out because their group's returns are all equal."""
        return self.reasons.count(UNIFORM)

    @property
    def surplus(self) -> int:
        """Samples of informative groups past `keep`, left out."""
        return self.reasons.count(SURPLUS)


def choose_groups(returns: Tensor, group_ids: Tensor, keep: int | None) -> ChosenGroups:
    """The groups of `returns` (N,) by `group_ids` (N,) that train: those whose returns are not all
    equal, the first `keep` of them when `keep` is set (None: all)."""
    ids, inverse = torch.unique(group_ids, return_inverse=True)
    first = torch.full((len(ids),), len(group_ids), dtype=torch.long).scatter_reduce(
        0, inverse, torch.arange(len(group_ids)), "amin")  # each group's first sample
    low = torch.full((len(ids),), float("inf"), dtype=returns.dtype).scatter_reduce(0, inverse, returns, "amin")
    high = torch.full((len(ids),), -float("inf"), dtype=returns.dtype).scatter_reduce(0, inverse, returns, "amax")
    informative = high > low  # (G,) in the order of `ids`
    order = torch.argsort(first)  # group slots in order of their first sample
    chosen = order[informative[order]]
    if keep is not None:
        chosen = chosen[:keep]
    kept_group = torch.zeros(len(ids), dtype=torch.bool)
    kept_group[chosen] = True
    kept = kept_group[inverse]
    alike = ~informative[inverse]
    reasons = [None if k else UNIFORM if a else SURPLUS for k, a in zip(kept.tolist(), alike.tolist(), strict=True)]
    return ChosenGroups(index=torch.nonzero(kept).flatten(), groups=len(chosen),
                        short=max(keep - len(chosen), 0) if keep is not None else 0, reasons=reasons)

