"""Stage costs from a run's trace, and the simulator graph of a schedule built from them.

    profile = profile_from_trace(events, devices={"rollout": "core0", "actor_train": "core1", ...})
    graph = profile.graph(iterations=8, minibatches=2, overlap_depth=1, schedule="stream")
    simulate(graph).iteration_s        # simulator.py: the prediction for that schedule

A step measured in a trace lasted longer than its work whenever another stage's step ran on the
same device at the same time (stages on one device time-share it). The profile therefore keeps
each step's *exclusive* cost: the integral over the step of 1 / (steps running on its device at
that moment), which is the time it would have taken alone when n overlapping steps share the
device equally. A stage's cost is kept per mini-batch position of an iteration (a trainer
collects an iteration's experiences and trains on the last one), as the mean over the
steady-state iterations (after `skip`, as the run's summary figures), which leaves out warm-up.

Steps on different devices of one host also slow each other (`SimGraph.contention`): with each
step's fraction of time overlapped by other devices' steps, one contention figure is fitted for
the whole trace (least squares over every stage's steps) and the costs are kept without it,
so a schedule that overlaps more (or less) than the calibration run is predicted with its own
slowdowns. A trace whose sides hardly overlapped (sync) cannot show contention: it fits 0.

Core lending (`placement.lend_idle_cores`, `SimStage.alone_speedup`): with `lending`, a stage on
the core board (every one but `driver/dataflow.py`'s `OFF_BOARD`) that is the only one in a step
computes on the other side's cores too. Each step's share of its exclusive cost spent with no
other board step running (a) is read off the trace, and per stage the speed-up s of those alone parts is fitted
after the contention figure, on the costs without contention: a step of own-core cost b lasts
b / (1 + (s - 1) * a), so cost = b - (s - 1) * a * cost, a line in (a * cost, cost) whose slope
least squares finds within each mini-batch position (one b each, one s for the stage). s is fitted
only where a varies within a position (`MIN_ALONE_SPREAD`: a sync run's trainer that always
steps alone cannot tell its speed-up from its cost); elsewhere it stays 1 and the profile says so
(`Profile.alone_speedup` lacks the stage). The costs kept are then own-core costs.

A run at overlap_depth >= 1 has no actor_forward (`driver/dataflow.py` `left_out_stages`: actor_train
computes the proximal log-probs itself, once an iteration); `Profile.for_stages` moves that
forward's cost into the trainer, or back out, so that a profile of one schedule predicts the
other's stages.

Edges come from the trace's flow arrows (producer stage -> consumer stage); weight costs from
its "weights publish" (the trainer's side) and "weights load" (rollout's) spans. What the run's
processes held comes from its summary, not the trace (`memory.py`, `Profile.memory`).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from stream_rlhf.driver.dataflow import OFF_BOARD
from stream_rlhf.planner.graph import SimGraph, SimStage
from stream_rlhf.planner.memory import NOT_SAMPLED, MemoryProfile
from stream_rlhf.planner.simulator import contended_fractions
from stream_rlhf.telemetry.trace_figures import TRAINER, is_leader_step, steady_window

ROLLOUT = "rollout"
CONTENTION_GRID = 150
"""Contentions tried: 0.00 to 1.50 in steps of 0.01."""
MIN_OVERLAP = 0.1
"""Contention is fitted only when at least this share of the steps' time overlapped other devices."""
Sample = tuple[float, float]
"""A step's (exclusive cost, fraction of its time that other devices' steps ran)."""
MIN_ALONE_SPREAD = 0.1
"""A stage's lending speed-up is fitted only when the share of its steps' costs they ran alone
varies by at least this much within a mini-batch position (a standard deviation, weighted by
the steps' costs)."""


@dataclass(frozen=True)
class Profile:
    step_s: dict[str, tuple[float, ...]]
    """Per stage and mini-batch position of an iteration: the mean exclusive cost of its
    steady-state steps."""
    minibatches: int
    inputs: dict[str, tuple[str, ...]]
    """Per stage: the stages whose outputs its steps consumed."""
    rollout_side: frozenset[str]
    publish_s: float
    weights_load_s: float
    contention: float = 0.0
    """How much the other devices' steps slowed a step (`SimGraph.contention`), fitted with the costs."""
    memory: MemoryProfile | None = None
    """What the run's processes held (`memory.py`, from its summary); None: not sampled."""
    alone_speedup: dict[str, float] = field(default_factory=dict)
    """Per stage whose speed-up alone with lent cores could be fitted (module docstring): s >= 1;
    a stage missing: 1 (the run lent no cores, or too little of its time alone to tell)."""

    def for_stages(self, stages: Collection[str]) -> Profile:
        """This profile for a run of the job with `stages`, which may differ from its own by
        actor_forward only (module docstring): left out, its steps' cost moves to actor_train's
        last mini-batch position (where the trainer now runs that forward); brought back, it costs
        what ref_forward does (the same model over the same rows), its inputs are ref_forward's,
        it feeds what ref_forward feeds, and that much leaves actor_train's last position.
        ValueError naming any other difference."""
        have, wanted = set(self.step_s), set(stages)
        if have == wanted:
            return self
        needed = {"actor_train"} if "actor_forward" in have else {"actor_train", "ref_forward"}
        if have ^ wanted != {"actor_forward"} or not needed <= have:
            raise ValueError(f"the profile's stages {sorted(have)} cannot stand for {sorted(wanted)} (only "
                             f"actor_forward may differ, with {' and '.join(sorted(needed))} in the profile)")
        train = list(self.step_s["actor_train"])
        if "actor_forward" in have:
            train[-1] += sum(self.step_s["actor_forward"])
            step_s = {name: cost for name, cost in self.step_s.items() if name != "actor_forward"}
            inputs = {name: tuple(i for i in sources if i != "actor_forward")
                      for name, sources in self.inputs.items() if name != "actor_forward"}
        else:
            forward = self.step_s["ref_forward"]
            train[-1] = max(0.0, train[-1] - sum(forward))
            step_s = {}
            for name, cost in self.step_s.items():
                step_s[name] = cost
                if name == "ref_forward":
                    step_s["actor_forward"] = forward
            inputs = {name: tuple(sorted({*sources, "actor_forward"})) if "ref_forward" in sources else sources
                      for name, sources in self.inputs.items()}
            inputs["actor_forward"] = self.inputs["ref_forward"]
        step_s["actor_train"] = tuple(train)
        speedups = {name: s for name, s in self.alone_speedup.items() if name in wanted}
        if "ref_forward" in speedups and "actor_forward" in wanted - have:
            speedups["actor_forward"] = speedups["ref_forward"]
        return replace(self, step_s=step_s, inputs=inputs, alone_speedup=speedups)

    def graph(self, iterations: int, overlap_depth: int, schedule: Literal["stream", "sync"],
              devices: dict[str, str], queue_capacity: int = 64,
              groups: Mapping[str, Sequence[str]] | None = None, lending: bool = False) -> SimGraph:
        """The simulator's graph of these stages under a schedule and a placement (`devices`:
        stage -> device set; stages missing from it get a device of their own; `groups`: device
        groups, name -> stages, each group's stages in one process on its first stage's device,
        offloading when another takes the device; `lending`: idle cores are lent between the
        sides, to the stages on the board: all but `OFF_BOARD` and the groups' members)."""
        process = {stage: name for name, members in (groups or {}).items() for stage in members}
        first = {name: members[0] for name, members in (groups or {}).items()}
        memory = self.memory or NOT_SAMPLED
        stages = []
        for name, cost in self.step_s.items():
            group = process.get(name, "")
            stages.append(SimStage(
                name, cost, inputs=self.inputs[name], side="rollout" if name in self.rollout_side else "train",
                device=devices.get(first[group], group) if group else devices.get(name, ""),
                barrier=schedule == "sync" and name not in self.rollout_side, process=group, offload=bool(group),
                memory_gb=memory.device_mb.get(name, 0.0) / 1024, load_s=memory.load_s.get(name, 0.0) if group else 0.0,
                processes=1 if group else memory.processes.get(name, 1), host_mb=memory.own_mb.get(name, 0.0),
                alone_speedup=self.alone_speedup.get(name, 1.0) if lending and not group and name not in OFF_BOARD
                else None))
        return SimGraph(stages=tuple(stages), iterations=iterations, minibatches=self.minibatches,
                        overlap_depth=overlap_depth, publish_s=self.publish_s, weights_load_s=self.weights_load_s,
                        queue_capacity=queue_capacity, contention=self.contention,
                        runtime_mb=self.memory.runtime_mb if self.memory else None, other_mb=memory.other_mb)


def profile_from_trace(events: list[dict[str, Any]], devices: dict[str, str], rollout_side: set[str],
                       skip: int | None = None, lending: bool = False) -> Profile:
    """The profile of a merged trace (trace.json's events) whose stages ran on `devices`;
    `lending`: the run lent idle cores between its sides (module docstring)."""
    window = steady_window(events, skip)
    if window is None:
        raise ValueError("the trace holds no steady-state iteration (too few trained iterations for `skip`)")
    steps = sorted((e for e in events if is_leader_step(e)), key=lambda e: e["ts"])
    exclusive = exclusive_costs(steps, devices)
    contended = contended_fractions([(devices.get(e["args"]["stage"], e["args"]["stage"]), e["ts"] / 1e6,
                                      (e["ts"] + e["dur"]) / 1e6) for e in steps])
    alone = alone_fractions(steps, exclusive) if lending else [0.0] * len(steps)
    minibatches = 1 + max(e["args"]["minibatch"] for e in steps)
    # (stage, mini-batch position) -> [(exclusive cost, contended fraction, alone fraction)];
    # stages in the order they first stepped; a position stepped only before the window (a source
    # that ran ahead) keeps all its steps
    every: dict[tuple[str, int], list[tuple[float, float, float]]] = {}
    steady: dict[tuple[str, int], list[tuple[float, float, float]]] = {}
    for event, cost, fraction, share in zip(steps, exclusive, contended, alone):
        key = (event["args"]["stage"], event["args"]["minibatch"])
        every.setdefault(key, []).append((cost, fraction, share))
        if event["ts"] / 1e6 >= window[0]:
            steady.setdefault(key, []).append((cost, fraction, share))
    groups = {key: steady.get(key) or samples for key, samples in every.items()}
    by_stage: dict[str, list[Sample]] = {}  # within one position the fraction hardly varies from one
    for (stage, _), samples in groups.items():  # iteration to the next: the fit pools the positions
        by_stage.setdefault(stage, []).extend((cost, fraction) for cost, fraction, _ in samples)
    contention = fit_contention(list(by_stage.values()))
    # (stage, position) -> [(cost without contention, alone fraction)]
    own = {key: [(cost / (1 + contention * fraction), share) for cost, fraction, share in samples]
           for key, samples in groups.items()}
    speedups: dict[str, float] = {}
    for stage in by_stage if lending else ():
        if (speedup := fit_alone_speedup([samples for (name, _), samples in own.items() if name == stage])) is not None:
            speedups[stage] = speedup
    step_s: dict[str, list[float]] = {}
    for (stage, position), samples in own.items():
        gain = speedups.get(stage, 1.0) - 1
        step_s.setdefault(stage, [0.0] * minibatches)[position] = statistics.fmean(
            cost * (1 + gain * share) for cost, share in samples)
    return Profile(step_s={stage: tuple(costs) for stage, costs in step_s.items()}, minibatches=minibatches,
                   inputs=flow_inputs(events, set(step_s)), rollout_side=frozenset(rollout_side & set(step_s)),
                   publish_s=_median_span(events, "weights publish", _stage_pids(events, TRAINER)),
                   weights_load_s=_median_span(events, "weights load", _stage_pids(events, ROLLOUT)),
                   contention=contention, alone_speedup=speedups)


def alone_fractions(steps: list[dict[str, Any]], exclusive: list[float]) -> list[float]:
    """Per step (trace events, with their `exclusive_costs`), the share of its exclusive cost
    spent while no other process's step of a stage on the core board ran (then it had its device
    to itself, so those seconds count whole); 0 for a step off the board (`OFF_BOARD`)."""
    board = [index for index, event in enumerate(steps) if event["args"]["stage"] not in OFF_BOARD]
    shared = contended_fractions([(str(steps[i]["pid"]), steps[i]["ts"] / 1e6, (steps[i]["ts"] + steps[i]["dur"]) / 1e6)
                                  for i in board])
    alone = [0.0] * len(steps)
    for index, fraction in zip(board, shared):
        if exclusive[index] > 0:
            alone[index] = min(1.0, (1 - fraction) * steps[index]["dur"] / 1e6 / exclusive[index])
    return alone


def fit_alone_speedup(positions: list[list[tuple[float, float]]]) -> float | None:
    """A stage's speed-up alone (>= 1) from its steps' (cost without contention, alone fraction),
    grouped by mini-batch position: the least-squares slope of cost against alone fraction x cost
    within the positions (module docstring); None where the alone fractions hardly vary
    (`MIN_ALONE_SPREAD`)."""
    weight = spread = covariance = variance = 0.0
    for samples in positions:
        mean_cost = statistics.fmean(cost for cost, _ in samples)
        mean_x = statistics.fmean(cost * share for cost, share in samples)
        mean_share = statistics.fmean(share for _, share in samples)
        for cost, share in samples:
            weight += cost
            spread += cost * (share - mean_share) ** 2
            covariance += (cost * share - mean_x) * (cost - mean_cost)
            variance += (cost * share - mean_x) ** 2
    if weight <= 0 or math.sqrt(spread / weight) < MIN_ALONE_SPREAD or variance <= 0:
        return None
    return 1 + max(0.0, -covariance / variance)


def base_cost(samples: list[Sample], contention: float) -> float:
    """A step's cost without contention: the mean of cost / (1 + contention * fraction) (the mean,
    not the median: a pipeline's throughput is set by the sum of its steps' times)."""
    return statistics.fmean(cost / (1 + contention * fraction) for cost, fraction in samples)


def fit_contention(groups: list[list[Sample]]) -> float:
    """The contention (0 to 1.5, in steps of 0.01) under which each group's steps (a stage's) best
    fit one base cost: least squares in seconds, so the long steps that make the iteration time
    weigh most. Ties go to the smallest; a trace whose steps overlapped other devices for less
    than MIN_OVERLAP of their time (a sync run) fits 0."""
    def error(contention: float) -> float:
        total = 0.0
        for samples in groups:
            base = base_cost(samples, contention)
            total += sum((cost - base * (1 + contention * fraction)) ** 2 for cost, fraction in samples)
        return total

    seconds = sum(cost for samples in groups for cost, _ in samples)
    overlapped = sum(cost * fraction for samples in groups for cost, fraction in samples)
    if overlapped < MIN_OVERLAP * seconds:  # a few brushes of a sync run fit noise, not contention
        return 0.0
    best, best_error = 0.0, error(0.0)
    for step in range(1, CONTENTION_GRID + 1):
        candidate = step / 100
        if (candidate_error := error(candidate)) < best_error * (1 - 1e-9):
            best, best_error = candidate, candidate_error
    return best


def exclusive_costs(steps: list[dict[str, Any]], devices: dict[str, str]) -> list[float]:
    """Per step (trace events), seconds it would have taken alone on its device (module docstring)."""
    by_device: dict[str, list[int]] = {}
    for index, event in enumerate(steps):
        stage = event["args"]["stage"]
        by_device.setdefault(devices.get(stage, stage), []).append(index)
    costs = [0.0] * len(steps)
    for indices in by_device.values():
        bounds = sorted({t for i in indices for t in (steps[i]["ts"], steps[i]["ts"] + steps[i]["dur"])})
        for lo, hi in zip(bounds, bounds[1:]):
            running = [i for i in indices if steps[i]["ts"] <= lo and hi <= steps[i]["ts"] + steps[i]["dur"]]
            for i in running:
                costs[i] += (hi - lo) / 1e6 / len(running)
    return costs


def flow_inputs(events: list[dict[str, Any]], stages: set[str]) -> dict[str, tuple[str, ...]]:
    """Per stage, the stages at the start of the flow arrows that end at it."""
    processes = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    starts = {e["id"]: processes[e["pid"]] for e in events if e.get("ph") == "s"}
    inputs: dict[str, set[str]] = {stage: set() for stage in stages}
    for event in events:
        if event.get("ph") == "f" and event["id"] in starts:
            consumer, producer = _stage_of(processes[event["pid"]]), _stage_of(starts[event["id"]])
            if consumer in inputs and producer in stages:
                inputs[consumer].add(producer)
    return {stage: tuple(sorted(names)) for stage, names in inputs.items()}


def _stage_of(process: str) -> str:
    """"actor_train-0" -> "actor_train"."""
    return process.rpartition("-")[0] or process


def _stage_pids(events: list[dict[str, Any]], stage: str) -> set[object]:
    return {e["pid"] for e in events if e.get("name") == "process_name" and _stage_of(e["args"]["name"]) == stage}


def _median_span(events: list[dict[str, Any]], name: str, pids: set[object]) -> float:
    spans = [e["dur"] / 1e6 for e in events if e.get("ph") == "X" and e["name"] == name and e["pid"] in pids]
    return statistics.median(spans) if spans else 0.0
