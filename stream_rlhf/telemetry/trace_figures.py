"""Figures of a run from its trace: per-stage busy fraction, bubble ratio and time hidden by overlap.

    figures = trace_figures(events, rollout_side={"prompts", "rollout"})   # events of trace.json
    figures.summary()   # {"busy": {...}, "bubble_ratio": ..., "overlap_hidden_s": ..., "window_s": ...}
    per_iteration = iteration_figures(events, rollout_side)   # the same over each iteration's own window

Pure functions over the merged events (`trace_merge.py`). The driver puts them in summary.json and
bench/pipeline.py reports them, both through `trace_figures`, so the two cannot disagree.

A *step* is an "X" event of category "step" (`broker/runtime/host.py`: one call of a stage's `step`,
payload fetch and publish excluded), with `args.stage` and `args.iteration`. The other ranks of
a stage group trace their share of each step too (`broker/runtime/group_follower.py`, with `args.rank`
> 0, on their own tracks); the figures count a group's step once, by its leader's event. Every
figure is taken over the steady-state window W = [lo, hi], with steps clipped to it:

    lo, hi            hi: the end of the last trained iteration (the latest end of an actor_train
                      step of that iteration); lo: the same for the `skip`-th trained iteration of
                      the trace (the first is skip 1), or with skip 0 the start of the first step.
                      Leaving out the first iterations leaves out start-up (processes, models), the
                      warm-up of the stages and the filling of the pipeline.
    window_s          hi - lo.
    busy[stage]       the sum of the stage's step durations (every instance) / window_s.
                      Wall time: stages that time-share a core can add up to more than 1.
    group_busy[side]  the rollout side (`rollout_side`) and the train side (every other stage):
                      the length of the union of the side's steps / window_s (steps of one side
                      that overlap count once).
    bubble_ratio      1 - (group_busy[rollout] + group_busy[train]) / 2. 0: both sides always have
                      a step running; 0.5: on average one side waits.
    overlap_hidden_s  the sum of the per-stage busy times (busy[stage] * window_s, summed) minus
                      the length of the union of every step: how much longer the window would be
                      if the same steps ran one after another. 0: no two steps ever overlapped.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

TRAINER = "actor_train"
"""The stage whose steps end an iteration (it publishes the next policy version)."""
STEADY_SKIP = 2
"""Trained iterations left out of the window by default (fewer when the run has fewer)."""
DIGITS = 4
"""Fractions in the summary are rounded to this many digits; seconds to 3."""

Span = tuple[float, float]


@dataclass(frozen=True)
class TraceFigures:
    lo: float
    """The window's start, seconds since the epoch (the trace's clock)."""
    hi: float
    busy: dict[str, float]
    group_busy: dict[str, float]
    bubble_ratio: float
    overlap_hidden_s: float

    @property
    def window_s(self) -> float:
        return self.hi - self.lo

    def record(self, iteration: int) -> dict[str, Any]:
        """One line of trace_metrics.jsonl (and TensorBoard's `trace/` tags) for `iteration`."""
        figures = self.summary()
        busy = {f"busy.{stage}": value for stage, value in figures.pop("busy").items()}
        return {"iteration": iteration, **figures, **busy}

    def summary(self) -> dict[str, Any]:
        """The figures as summary.json's `trace` holds them."""
        return {
            "busy": {stage: round(value, DIGITS) for stage, value in sorted(self.busy.items())},
            "bubble_ratio": round(self.bubble_ratio, DIGITS),
            "overlap_hidden_s": round(self.overlap_hidden_s, 3),
            "window_s": round(self.window_s, 3),
        }


def is_leader_step(event: dict[str, Any]) -> bool:
    """A step event of a stage instance's leader (the figures' steps, see the module docstring)."""
    return event.get("ph") == "X" and event.get("cat") == "step" and event["args"].get("rank", 0) == 0


def step_spans(events: Iterable[dict[str, Any]]) -> dict[str, list[Span]]:
    """Per stage, its steps as (start, end) in seconds."""
    spans: dict[str, list[Span]] = {}
    for event in events:
        if is_leader_step(event):
            start = event["ts"] / 1e6
            spans.setdefault(event["args"]["stage"], []).append((start, start + event["dur"] / 1e6))
    return spans


def iteration_ends(events: Iterable[dict[str, Any]]) -> dict[int, float]:
    """Trained iteration -> the end of its last actor_train step (seconds)."""
    ends: dict[int, float] = {}
    for event in events:
        if is_leader_step(event) and event["args"]["stage"] == TRAINER:
            iteration = event["args"]["iteration"]
            ends[iteration] = max(ends.get(iteration, 0.0), (event["ts"] + event["dur"]) / 1e6)
    return ends


def steady_window(events: list[dict[str, Any]], skip: int | None = None) -> Span | None:
    """(lo, hi) of the window (see the module docstring); `skip` None: STEADY_SKIP, or one less
    than the trained iterations when there are fewer. None when no iteration was trained past
    `skip`."""
    ends = [end for _, end in sorted(iteration_ends(events).items())]
    if skip is None:
        skip = max(0, min(STEADY_SKIP, len(ends) - 1))
    if len(ends) <= skip:
        return None
    if skip == 0:
        starts = [start for spans in step_spans(events).values() for start, _ in spans]
        return min(starts), ends[-1]
    return ends[skip - 1], ends[-1]


def trace_figures(events: list[dict[str, Any]], rollout_side: Iterable[str],
                  skip: int | None = None) -> TraceFigures | None:
    """The figures of the window `steady_window(events, skip)`; None when it is empty."""
    window = steady_window(events, skip)
    if window is None or window[1] <= window[0]:
        return None
    return window_figures(step_spans(events), window[0], window[1], rollout_side)


def iteration_figures(events: list[dict[str, Any]], rollout_side: Iterable[str]) -> dict[int, TraceFigures]:
    """Trained iteration i -> the figures of its own window, from the end of the previous trained
    iteration to its end (the first trained iteration of the trace has none)."""
    ends = sorted(iteration_ends(events).items())
    spans = step_spans(events)
    return {iteration: window_figures(spans, lo, hi, rollout_side)
            for (_, lo), (iteration, hi) in zip(ends, ends[1:]) if hi > lo}


def window_figures(spans: dict[str, list[Span]], lo: float, hi: float, rollout_side: Iterable[str]) -> TraceFigures:
    """The figures of the steps `spans` (per stage) clipped to the window [lo, hi], hi > lo."""
    length = hi - lo
    per_stage = {stage: clip(stage_spans, lo, hi) for stage, stage_spans in spans.items()}
    busy_s = {stage: sum(end - start for start, end in spans) for stage, spans in per_stage.items()}
    rollout_side = set(rollout_side)
    sides: dict[str, list[Span]] = {"rollout": [], "train": []}
    for stage, spans in per_stage.items():
        sides["rollout" if stage in rollout_side else "train"].extend(spans)
    group_busy = {side: merged_length(spans) / length for side, spans in sides.items()}
    union = merged_length([span for spans in per_stage.values() for span in spans])
    return TraceFigures(
        lo=lo,
        hi=hi,
        busy={stage: seconds / length for stage, seconds in busy_s.items()},
        group_busy=group_busy,
        bubble_ratio=1 - (group_busy["rollout"] + group_busy["train"]) / 2,
        overlap_hidden_s=sum(busy_s.values()) - union,
    )


def merged_length(spans: list[Span]) -> float:
    """Length of the union of the (start, end) spans."""
    return sum(end - start for start, end in merged_spans(spans))


def merged_spans(spans: list[Span]) -> list[Span]:
    """The union of the (start, end) spans as disjoint spans, in order."""
    merged: list[Span] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def clip(spans: list[Span], lo: float, hi: float) -> list[Span]:
    return [(max(s, lo), min(e, hi)) for s, e in spans if e > lo and s < hi]
