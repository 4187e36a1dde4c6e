"""A discrete-event simulator of the dataflow: predicts a run's iteration time, busy fractions,
bubble ratio, staleness, peak memory per device and the job's host memory from its stages' step
costs and memory.

    prediction = simulate(graph)      # graph.py: stages, inputs, devices, costs
    prediction.iteration_s, prediction.figures.bubble_ratio, prediction.figures.busy["rollout"]

The rules are the engine's, at mini-batch granularity:

    a step of stage S on mini-batch (i, m) starts at the latest of
      - S's step on the mini-batch before (one instance: its handles in order);
      - each input's step on (i, m) (a join waits for all); with `barrier` (the sync schedule),
        each input's steps on every mini-batch of iteration i;
      - rollout only: the publication of policy version i - overlap_depth (admission); version
        v + 1 is published `publish_s` after the trainer's last step of iteration v;
      - back-pressure: the start of each consumer's step on S's output queue_capacity earlier;
      - its device being free (one step at a time per device).
    it lasts step_s (its mini-batch position's), plus load_s for a stage that `offload`s when
    the device's previous step (a device group's: its process's) was another stage's (with
    `prefetch`: only the part of load_s beyond the time since that step started), plus
    weights_load_s for rollout's first step on a newer version.

Contention (`graph.contention` = c > 0): steps on different devices of one host slow each other
(memory bandwidth, shared caches, SMT siblings: generation on one core of this 2-core VM runs up
to 45% slower while training runs on the other). A step whose span overlaps other devices' steps
for a fraction f of its time lasts cost * (1 + c * f). The slowdowns depend on the schedule
and the schedule on them, so the schedule is recomputed with the fractions of the previous one
(damped by averaging) until they settle.

Core lending (`SimStage.alone_speedup` = s, `placement.lend_idle_cores`): a stage on the core
board whose step is the only board stage's step running computes on the other side's cores too
and progresses s times faster. A step alone for a fraction a of its span gets through
s * a + (1 - a) seconds of its own-core cost per second, so it lasts cost / (1 + (s - 1) * a);
with contention, cost * (1 + c * f) / (1 + (s - 1) * a), both fractions of its span. The
fractions settle with contention's, in the same rounds.

Scheduling is list scheduling in time order: of the steps whose predecessors are all placed, the
one that can start first goes next (ties: the one ready first, waiting only for its device, then
the graph's stage order, which puts inputs first), so a device never idles while a placed step
could run on it, its queue is first come first served (as the OS shares a core between the
processes that wait for it: a stage is not starved by others that always have a step ready), and
the result is deterministic.

The figures come from the simulated steps through `telemetry/trace_figures.py`, the functions
that turn a real run's trace into its summary figures: a prediction and a measurement are the
same quantities by construction. `iteration_s` is the steady-state window over the number of
iterations it holds.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from stream_rlhf.planner.graph import SimGraph, SimStage
from stream_rlhf.planner.memory import process_memory
from stream_rlhf.telemetry.trace_figures import STEADY_SKIP, TraceFigures, merged_spans, trace_figures

CONTENTION_ROUNDS = 50
"""At most this many re-schedulings to settle the slowdowns of contention (graph.contention)."""


@dataclass(frozen=True)
class SimStep:
    stage: str
    iteration: int
    minibatch: int
    start_s: float
    end_s: float
    policy_version: int = -1
    """Rollout only: the version its weights were (staleness = iteration - policy_version)."""


@dataclass(frozen=True)
class Prediction:
    steps: tuple[SimStep, ...]
    figures: TraceFigures | None
    """Over the steady-state window (None: too few iterations for one)."""
    iteration_s: float
    makespan_s: float
    staleness_max: int
    peak_memory_gb: dict[str, float]
    """Per device: every resident stage's memory, plus the largest of the ones that offload, plus
    for each device group's process the largest of its stages (one of them is on the device)."""
    host_mb: dict[str, float] | None = None
    """Per process (stage or device group, `memory.py`): host MB at its peak; None: not known."""

    @property
    def peak_host_mb(self) -> float | None:
        """The job's host memory: its processes' peaks summed."""
        return None if self.host_mb is None else sum(self.host_mb.values())

    def summary(self) -> dict[str, object]:
        figures = self.figures.summary() if self.figures is not None else {}
        return {"iteration_s": round(self.iteration_s, 6), "makespan_s": round(self.makespan_s, 6),
                "staleness_max": self.staleness_max, "peak_memory_gb": self.peak_memory_gb,
                "peak_mem_mb": None if self.peak_host_mb is None else round(self.peak_host_mb, 1),
                "peak_mem_mb_per_process": None if self.host_mb is None else
                {name: round(mb, 1) for name, mb in self.host_mb.items()}, **figures}


def simulate(graph: SimGraph, skip: int | None = None) -> Prediction:
    """The schedule of `graph` and its figures; `skip`: trained iterations left out of the steady
    state (None: as the run's summary does, `trace_figures`' default)."""
    slowdown: dict[tuple[str, int], float] = {}
    steps = _schedule(graph, slowdown)
    for _ in range(CONTENTION_ROUNDS if graph.contention > 0 or graph.lending else 0):
        fractions = contended_fractions([(graph.stage(s.stage).device or s.stage, s.start_s, s.end_s) for s in steps])
        speedups = alone_speedups(graph, steps)
        target = {(s.stage, s.iteration * graph.minibatches + s.minibatch): (1 + graph.contention * f) / speedup
                  for s, f, speedup in zip(steps, fractions, speedups)}
        damped = {key: (slowdown.get(key, 1.0) + value) / 2 for key, value in target.items()}  # no oscillation
        settled = max(abs(value - slowdown.get(key, 1.0)) for key, value in damped.items()) < 1e-6
        slowdown = damped
        steps = _schedule(graph, slowdown)
        if settled:
            break
    events = [trace_event(step) for step in steps]
    rollout_side = {stage.name for stage in graph.stages if stage.side == "rollout"}
    figures = trace_figures(events, rollout_side, skip)
    left_out = min(STEADY_SKIP, graph.iterations - 1) if skip is None else skip
    if figures is not None and graph.iterations > left_out:
        iteration_s = figures.window_s / (graph.iterations - left_out)
    else:
        iteration_s = max(step.end_s for step in steps) / graph.iterations
    versions = [step.iteration - step.policy_version for step in steps if step.policy_version >= 0]
    return Prediction(steps=tuple(steps), figures=figures, iteration_s=iteration_s,
                      makespan_s=max(step.end_s for step in steps), staleness_max=max(versions, default=0),
                      peak_memory_gb=peak_memory(graph), host_mb=process_memory(graph))


def contended_fractions(spans: list[tuple[str, float, float]]) -> list[float]:
    """Per (device, start, end) span, the fraction of it during which a span of another device ran."""
    others = {device: merged_spans([(start, end) for other, start, end in spans if other != device])
              for device in {device for device, _, _ in spans}}
    starts = {device: [start for start, _ in union] for device, union in others.items()}
    fractions = []
    for device, start, end in spans:
        union, covered = others[device], 0.0
        index = max(bisect.bisect_right(starts[device], start) - 1, 0)
        while index < len(union) and union[index][0] < end:
            covered += max(0.0, min(end, union[index][1]) - max(start, union[index][0]))
            index += 1
        fractions.append(covered / (end - start) if end > start else 0.0)
    return fractions


def alone_speedups(graph: SimGraph, steps: list[SimStep]) -> list[float]:
    """Per step, 1 + (s - 1) * (the fraction of its span with no other board stage's step running),
    s its stage's `alone_speedup` (1 for a stage off the board)."""
    if not graph.lending:  # no stage runs faster alone: nothing to measure
        return [1.0] * len(steps)
    board = [index for index, step in enumerate(steps) if graph.stage(step.stage).alone_speedup is not None]
    shared = contended_fractions([(steps[i].stage, steps[i].start_s, steps[i].end_s) for i in board])
    speedups = [1.0] * len(steps)
    for index, fraction in zip(board, shared):
        speedups[index] = 1 + ((graph.stage(steps[index].stage).alone_speedup or 1.0) - 1) * (1 - fraction)
    return speedups


def peak_memory(graph: SimGraph) -> dict[str, float]:
    """Per device (`Prediction.peak_memory_gb`): a device group holds its largest member, or its
    two largest when a member prefetches (the next one's onload overlaps the current one's step)."""
    devices: dict[str, list[SimStage]] = {}
    for stage in graph.stages:
        devices.setdefault(stage.device or stage.name, []).append(stage)
    peaks = {}
    for device, held in devices.items():
        groups: dict[str, list[SimStage]] = {}
        for stage in held:
            if stage.process:
                groups.setdefault(stage.process, []).append(stage)
        alone = [stage for stage in held if not stage.process]
        peaks[device] = (sum(s.memory_gb for s in alone if not s.offload) + sum(map(_group_peak, groups.values()))
                         + max((s.memory_gb for s in alone if s.offload), default=0.0))
    return peaks


def _group_peak(members: list[SimStage]) -> float:
    sizes = sorted((s.memory_gb for s in members), reverse=True)
    return sum(sizes[:2]) if any(s.prefetch for s in members) else sizes[0]


def trace_event(step: SimStep) -> dict[str, object]:
    """A step as the trace records one (`broker/runtime/host.py`), times in whole microseconds."""
    start, end = round(step.start_s * 1e6), round(step.end_s * 1e6)
    return {"ph": "X", "cat": "step", "name": step.stage, "ts": start, "dur": end - start, "pid": step.stage,
            "tid": "rank 0", "args": {"stage": step.stage, "iteration": step.iteration, "minibatch": step.minibatch}}


class _State:
    """What the list scheduler has placed so far."""

    def __init__(self, graph: SimGraph):
        self.graph = graph
        self.start: dict[tuple[str, int], float] = {}
        self.end: dict[tuple[str, int], float] = {}
        self.placed = {stage.name: 0 for stage in graph.stages}  # steps placed per stage, in order
        self.device_free: dict[str, float] = {}
        self.last_step: dict[tuple[str, str], str] = {}
        """("device" or "process", its name) -> the stage that stepped there last."""
        self.last_start: dict[tuple[str, str], float] = {}
        """("device" or "process", its name) -> when the last step there started."""
        self.rollout_version = 0

    def published(self, version: int) -> float | None:
        """When policy version `version` becomes loadable (None: its training is not placed yet)."""
        if version <= 0:
            return 0.0
        last = self.end.get((self.graph.trainer, version * self.graph.minibatches - 1))
        return None if last is None else last + self.graph.publish_s

    def newest_version(self, at_s: float) -> int:
        version = self.rollout_version
        while (when := self.published(version + 1)) is not None and when <= at_s:
            version += 1
        return version


def _schedule(graph: SimGraph, slowdown: dict[tuple[str, int], float]) -> list[SimStep]:
    """The steps of `graph`, each stage's step `index` taking its cost times `slowdown[(stage,
    index)]` (1 when absent)."""
    state = _State(graph)
    order = graph.order()
    total = graph.iterations * graph.minibatches
    steps: list[SimStep] = []
    while len(steps) < total * len(order):
        candidates = [(*times, position, name) for position, name in enumerate(order)
                      if (times := _earliest_start(state, name, total)) is not None]
        if not candidates:
            waiting = {name: divmod(state.placed[name], graph.minibatches) for name in order
                       if state.placed[name] < total}
            raise ValueError(f"the dataflow cannot go on (iteration, mini-batch next per stage: {waiting}); "
                             "a sync barrier behind a queue_capacity below the mini-batches per iteration?")
        start, _, _, name = min(candidates)
        steps.append(_place(state, name, start, slowdown.get((name, state.placed[name]), 1.0)))
    return sorted(steps, key=lambda step: (step.start_s, order.index(step.stage)))


def _earliest_start(state: _State, name: str, total: int) -> tuple[float, float] | None:
    """When stage `name`'s next step can start and when it became ready (all but its device
    free), or None while something it waits for is unplaced."""
    graph, stage = state.graph, state.graph.stage(name)
    index = state.placed[name]
    if index == total:
        return None
    iteration = index // graph.minibatches
    waits = [state.end.get((name, index - 1), 0.0) if index else 0.0]
    for source in stage.inputs:
        needed = range(iteration * graph.minibatches, (iteration + 1) * graph.minibatches) if stage.barrier \
            else [index]
        waits += [state.end.get((source, j)) for j in needed]
    if name == graph.rollout:
        waits.append(state.published(iteration - graph.overlap_depth))
    if index >= graph.queue_capacity:
        waits += [state.start.get((consumer, index - graph.queue_capacity)) for consumer in graph.consumers(name)]
    if any(wait is None for wait in waits):
        return None
    ready = max(waits)
    return max(ready, state.device_free.get(stage.device or name, 0.0)), ready


def _place(state: _State, name: str, start: float, slowdown: float) -> SimStep:
    graph, stage = state.graph, state.graph.stage(name)
    index = state.placed[name]
    device = stage.device or name
    duration = graph.step_s(name, index % graph.minibatches) * slowdown
    holder = ("process", stage.process) if stage.process else ("device", device)
    if stage.offload and state.last_step.get(holder) != name:
        hidden = start - state.last_start.get(holder, start) if stage.prefetch else 0.0
        duration += max(0.0, stage.load_s - hidden)
    version = -1
    if name == graph.rollout:
        version = state.newest_version(start)
        if version > state.rollout_version:
            duration += graph.weights_load_s
            state.rollout_version = version
    end = start + duration
    state.start[(name, index)], state.end[(name, index)] = start, end
    state.placed[name] += 1
    state.device_free[device] = end
    state.last_step[("device", device)] = state.last_step[holder] = name
    state.last_start[("device", device)] = state.last_start[holder] = start
    iteration, minibatch = divmod(index, graph.minibatches)
    return SimStep(name, iteration, minibatch, start, end, version)
