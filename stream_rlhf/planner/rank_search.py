"""Ranks per stage group as a search axis, for analytic costs on several devices.

    plans = search_ranks(lambda ranks: analytic_profile(stages, shape, work, device, ranks),
                         device_count=8, iterations=20)
    plans[0].ranks       # {"rollout": 2, "ref_forward": 6, ...}: rollout instances, ranks per stage
    plans[0].sets        # ... "rollout.instances=2", "placement.stages.ref_forward.ranks=6", ...

The two stage groups of a placement mode share the job's `device_count` devices:

    colocated   every stage on every device: each has device_count ranks (rollout: instances)
    separated   the rollout side on r devices (rollout.instances=r), the train side on the other
                device_count - r, each of its stages with that many ranks; r in 1, 2, 4, ... and
                device_count - 1, - 2, - 4, ... (below device_count)

Device groups (`placement.device_groups`) are tried where their members have the same ranks
(the config refuses a group whose members differ; one process per rank hosts every member). A
stage's cost on n devices is the profile
factory's (`analytic.py`: data parallel, its compute over n at an efficiency, a trainer's
gradient all-reduce over the link). With one device per group (a CPU: one side's cores each)
the axis has one point and the search is `search.py`'s, `placement.with_rollout` included; with
several devices a stage on rollout's cores would need rollout's ranks, and no stage is moved
there (`with_rollout` is not searched). Not checked: a trainer's ranks against
its smallest optimizer step (the config refuses more ranks than samples in a step).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace

from stream_rlhf.planner.calibrate import Profile
from stream_rlhf.planner.search import MODES, Groups, Mode, Moved, Plan, device_group_candidates, search

RankFactory = Callable[[Mapping[str, int]], Profile]
"""Ranks per stage -> the profile of the stages on that many devices each."""


def rank_splits(stages: Sequence[str], rollout_side: frozenset[str], device_count: int,
                mode: Mode) -> list[dict[str, int]]:
    """The ranks per stage tried for `mode` (module docstring); [{}] with one device."""
    if device_count < 2:
        return [{}]
    if mode == "colocated":
        return [{stage: device_count for stage in stages}]
    halves = {1 << i for i in range(device_count.bit_length())} | {device_count - (1 << i)
                                                                   for i in range(device_count.bit_length())}
    return [{stage: r if stage in rollout_side else device_count - r for stage in stages}
            for r in sorted(r for r in halves if 0 < r < device_count)]


def search_ranks(profile_of: RankFactory, device_count: int, iterations: int, max_overlap_depth: int = 2,
                 modes: tuple[Mode, ...] = MODES, groups: Sequence[Groups] | None = None,
                 with_rollout: Sequence[Moved] | None = None) -> list[Plan]:
    """`search.py`'s search for every ranks split of every mode, best first (ties: fewer devices
    on the rollout side, then as `search` orders); `with_rollout` is searched on one device only
    (module docstring)."""
    base = profile_of({})
    candidates = device_group_candidates(base.step_s) if groups is None else groups
    plans: list[Plan] = []
    for mode in modes:
        for ranks in rank_splits(list(base.step_s), base.rollout_side, device_count, mode):
            profile = profile_of(ranks) if ranks else base
            tried = [g for g in candidates if _same_ranks(g, ranks)]
            moves = with_rollout if device_count < 2 else [()]
            plans += [replace(plan, ranks=ranks) for plan in search(profile, iterations, max_overlap_depth, (mode,),
                                                                    tried, moves)]
    return sorted(plans, key=lambda plan: (round(plan.prediction.iteration_s, 9), plan.overlap_depth))


def _same_ranks(groups: Groups, ranks: Mapping[str, int]) -> bool:
    """Every device group's members have as many ranks as each other under `ranks`."""
    return all(len({ranks.get(member, 1) for member in members}) == 1 for members in groups.values())
