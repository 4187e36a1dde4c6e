"""DAPO's dynamic sampling choice (`algos/group_filter.py`): which groups train, in which order,
and what is counted as left out; and the progress line that shows it."""

from __future__ import annotations

import torch

from stream_rlhf.algos.group_filter import choose_groups
from stream_rlhf.telemetry.progress import describe

RETURNS = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.1, 0.1, 1.0, 0.0, 0.0, 0.5])
GROUPS = torch.tensor([7, 7, 3, 3, 9, 9, 1, 1, 5, 5])  # ids out of order: the samples' order decides
"""Groups 7 and 9 score alike throughout; 3, 1 and 5 differ, in that order of their first samples."""


def test_groups_of_equal_returns_are_left_out_and_the_rest_keep_their_order():
    chosen = choose_groups(RETURNS, GROUPS, None)
    assert chosen.index.tolist() == [2, 3, 6, 7, 8, 9]
    assert (chosen.groups, chosen.uniform, chosen.surplus, chosen.short) == (3, 4, 0, 0)


def test_keep_takes_the_first_informative_groups_and_counts_the_rest_as_surplus():
    chosen = choose_groups(RETURNS, GROUPS, 2)
    assert chosen.index.tolist() == [2, 3, 6, 7]  # groups 3 and 1: the first two with a spread
    assert (chosen.groups, chosen.uniform, chosen.surplus, chosen.short) == (2, 4, 2, 0)


def test_keep_beyond_the_informative_groups_is_counted_short():
    chosen = choose_groups(RETURNS, GROUPS, 5)
    assert chosen.index.tolist() == [2, 3, 6, 7, 8, 9]
    assert (chosen.groups, chosen.short) == (3, 2)


def test_when_every_group_scores_alike_nothing_trains():
    chosen = choose_groups(torch.tensor([0.5, 0.5, 0.0, 0.0]), torch.tensor([0, 0, 1, 1]), 4)
    assert chosen.index.tolist() == [] and (chosen.groups, chosen.uniform, chosen.short) == (0, 4, 4)


def test_a_difference_in_the_last_bit_counts_and_groups_may_be_interleaved():
    """Equality is exact (a group's returns computed alike are bit-equal); a group need not be contiguous."""
    returns = torch.tensor([0.3, 0.3, 0.3, torch.nextafter(torch.tensor(0.3), torch.tensor(1.0)).item()])
    chosen = choose_groups(returns, torch.tensor([4, 2, 4, 2]), None)
    assert chosen.index.tolist() == [1, 3] and chosen.uniform == 2


def test_the_progress_line_shows_the_groups_trained_only_with_dynamic_sampling():
    record = {"iteration": 0, "reward": 0.5, "kl": 0.01, "tokens_per_s": 100.0}
    assert "groups" not in describe(record)
    line = describe(record | {"groups_trained": 21, "groups_uniform_frac": 0.34375, "groups_short": 0})
    assert line.endswith("21 groups trained (34% alike left out)")
