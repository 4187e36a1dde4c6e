"""The trace's figures (`telemetry/trace_figures.py`) on hand-made steps, to the exact number.

    seconds   0    1    2    3    4    5    6    7    8    9
    actor_train [it0]               [it1]               [it2]
    rollout        [-------it1-----]    [--it2--]
    ref_forward              [--it1--)           (ref_forward 3 .. 4.5)

With skip 1 the window runs from the end of iteration 0's training (1 s) to the end of
iteration 2's (9 s): 8 s.
"""

from __future__ import annotations

import pytest

from stream_rlhf.telemetry.trace_figures import iteration_figures, merged_length, steady_window, trace_figures

ROLLOUT_SIDE = {"prompts", "rollout"}


def step(stage: str, start_s: float, end_s: float, iteration: int) -> dict:
    return {"ph": "X", "cat": "step", "name": stage, "ts": int(start_s * 1e6), "dur": int((end_s - start_s) * 1e6),
            "pid": 1, "tid": 0, "args": {"stage": stage, "iteration": iteration, "minibatch": 0}}


EVENTS = [
    step("actor_train", 0, 1, 0), step("actor_train", 4, 5, 1), step("actor_train", 8, 9, 2),
    step("rollout", 1, 4, 1), step("rollout", 5, 7, 2),
    step("ref_forward", 3, 4.5, 1),
    {"ph": "X", "cat": "payload", "name": "fetch", "ts": 2_000_000, "dur": 5_000_000, "pid": 1, "tid": 0, "args": {}},
    {"ph": "C", "name": "queue rollout>ref_forward", "ts": 2_000_000, "pid": 2, "tid": 0, "args": {"value": 3}},
]


def test_two_overlapping_sides_with_gaps():
    figures = trace_figures(EVENTS, ROLLOUT_SIDE, skip=1)
    assert (figures.lo, figures.hi, figures.window_s) == (1.0, 9.0, 8.0)
    # actor_train's iteration 0 ends at the window's start: left out; fetches are not steps
    assert figures.busy == {"actor_train": 2 / 8, "rollout": 5 / 8, "ref_forward": 1.5 / 8}
    # train side: ref_forward 3..4.5 and actor_train 4..5 merge into 3..5, then 8..9
    assert figures.group_busy == {"rollout": 5 / 8, "train": 3 / 8}
    assert figures.bubble_ratio == 0.5
    # steps add up to 8.5 s; their union (1..7 and 8..9) is 7 s
    assert figures.overlap_hidden_s == 1.5
    assert figures.summary() == {"busy": {"actor_train": 0.25, "ref_forward": 0.1875, "rollout": 0.625},
                                 "bubble_ratio": 0.5, "overlap_hidden_s": 1.5, "window_s": 8.0}


def test_the_window_leaves_out_the_first_trained_iterations():
    assert steady_window(EVENTS, skip=0) == (0.0, 9.0)  # from the first step's start
    assert steady_window(EVENTS, skip=2) == (5.0, 9.0)
    assert steady_window(EVENTS) == (5.0, 9.0)  # STEADY_SKIP = 2 of 3 trained iterations
    assert steady_window(EVENTS[:2]) == (1.0, 5.0)  # 2 trained iterations: one left out
    assert steady_window(EVENTS, skip=3) is None
    assert trace_figures(EVENTS[3:], ROLLOUT_SIDE) is None  # nothing trained


def test_skip_two_counts_only_the_last_iteration():
    figures = trace_figures(EVENTS, ROLLOUT_SIDE, skip=2)
    assert figures.window_s == 4.0
    assert figures.busy == {"actor_train": 1 / 4, "rollout": 2 / 4, "ref_forward": 0.0}
    assert figures.bubble_ratio == 1 - (2 / 4 + 1 / 4) / 2
    assert figures.overlap_hidden_s == 0.0  # nothing overlaps after 5 s


def test_each_iteration_has_the_figures_of_its_own_window():
    per_iteration = iteration_figures(EVENTS, ROLLOUT_SIDE)
    assert sorted(per_iteration) == [1, 2]  # iteration 0 has no previous end to start from
    one, two = per_iteration[1], per_iteration[2]
    assert (one.lo, one.hi, two.lo, two.hi) == (1.0, 5.0, 5.0, 9.0)
    assert one.busy == {"actor_train": 1 / 4, "rollout": 3 / 4, "ref_forward": 1.5 / 4}
    assert two.summary() == trace_figures(EVENTS, ROLLOUT_SIDE, skip=2).summary()
    assert one.record(1) == {"iteration": 1, "bubble_ratio": 1 - (3 / 4 + 2 / 4) / 2, "overlap_hidden_s": 1.5,
                             "window_s": 4.0, "busy.actor_train": 0.25, "busy.ref_forward": 0.375,
                             "busy.rollout": 0.75}


@pytest.mark.parametrize(("spans", "length"), [
    ([], 0.0),
    ([(0, 2), (1, 3)], 3.0),
    ([(0, 10), (2, 3), (4, 5)], 10.0),  # nested
    ([(5, 6), (0, 1)], 2.0),  # unsorted, apart
    ([(0, 1), (1, 2)], 2.0),  # touching
])
def test_merged_length(spans, length):
    assert merged_length(spans) == length


def test_other_ranks_steps_are_left_out_of_the_figures():
    """A 2-rank actor_train's rank 1 traces its share of each step (longer, later): the figures
    count the group's step once, by its leader's event."""
    followers = [{**step("actor_train", start, end, iteration), "tid": 1,
                  "args": {**step("actor_train", start, end, iteration)["args"], "rank": 1}}
                 for start, end, iteration in ((0, 1.5, 0), (4, 6, 1), (8, 9.5, 2))]
    assert trace_figures(EVENTS + followers, ROLLOUT_SIDE, skip=1) == trace_figures(EVENTS, ROLLOUT_SIDE, skip=1)
    assert steady_window(EVENTS + followers, skip=1) == (1.0, 9.0)
