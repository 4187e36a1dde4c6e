"""Searching schedules and placements with the simulator: which `--set`s make a job fastest.

    plans = search(profile, iterations=8)        # profile: calibrate.py, from a run's trace
    plans[0].sets        # ["schedule=stream", "overlap_depth=1", "placement.mode=separated"]
    plans[0].prediction  # simulator.py: iteration_s, bubble ratio, busy fractions, staleness

Candidates are every schedule x overlap depth x placement mode the engine runs:

    sync             overlap_depth 0 (its barriers already serialise the phases)
    stream           overlap_depth 0 .. max_overlap_depth
    separated        the rollout side (rl/dataflow.py ROLLOUT_SIDE) on one device set, every other
                     stage on the other; steps of the two slow each other by the profile's contention
    colocated        every stage on one device set, one step at a time, no contention

A profile measured with cores lent between the sides (`placement.lend_idle_cores`, the default)
holds each step's cost with every core it could borrow, which is also its cost colocated; a
profile measured without lending holds one side's cores only: search it in its own mode
(`modes=`). Plans are ranked by predicted iteration time; ties go to the smaller overlap depth
(less staleness), then to the order above.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from stream_rlhf.planner.calibrate import Profile
from stream_rlhf.planner.simulator import Prediction, simulate

Mode = Literal["separated", "colocated"]
MODES: tuple[Mode, ...] = ("separated", "colocated")


@dataclass(frozen=True)
class Plan:
    schedule: Literal["stream", "sync"]
    overlap_depth: int
    mode: Mode
    prediction: Prediction

    @property
    def sets(self) -> list[str]:
        """The `--set` lines that make a config run this plan."""
        return [f"schedule={self.schedule}", f"overlap_depth={self.overlap_depth}", f"placement.mode={self.mode}"]


def devices_of(profile: Profile, mode: Mode) -> dict[str, str]:
    """Stage -> device set under a placement mode."""
    if mode == "colocated":
        return {stage: "all cores" for stage in profile.step_s}
    return {stage: "rollout cores" if stage in profile.rollout_side else "train cores" for stage in profile.step_s}


def predict(profile: Profile, iterations: int, schedule: Literal["stream", "sync"], overlap_depth: int,
            mode: Mode) -> Prediction:
    graph = profile.graph(iterations=iterations, overlap_depth=overlap_depth, schedule=schedule,
                          devices=devices_of(profile, mode))
    if mode == "colocated":  # one device set: nothing runs beside a step to slow it
        graph = replace(graph, contention=0.0)
    return simulate(graph)


def search(profile: Profile, iterations: int, max_overlap_depth: int = 2,
           modes: tuple[Mode, ...] = MODES) -> list[Plan]:
    """Every candidate (module docstring), best first."""
    candidates: list[tuple[Literal["stream", "sync"], int]] = [("sync", 0)]
    candidates += [("stream", depth) for depth in range(max_overlap_depth + 1)]
    plans = [Plan(schedule, depth, mode, predict(profile, iterations, schedule, depth, mode))
             for mode in modes for schedule, depth in candidates]
    order = {id(plan): position for position, plan in enumerate(plans)}
    return sorted(plans, key=lambda plan: (round(plan.prediction.iteration_s, 9), plan.overlap_depth,
                                           order[id(plan)]))
