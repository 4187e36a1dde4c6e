"""Memory in the planner: what a calibration run's processes held, and the peak memory of a plan.

    memory = memory_profile(json.loads((run_dir / "summary.json").read_text()))   # None: not sampled
    graph = profile.graph(..., groups={"forwards": ["ref_forward", "critic_forward"]})  # calibrate.py
    process_memory(graph)    # {"prompts": 327.0, "rollout": 304.0, "forwards": 331.0, ...} MB

Host memory (the run summary's `memory` block, `telemetry/memory.py`: peak PSS per process) is
modelled as a runtime every stage process carries (the interpreter, torch, the stage runner) plus
each stage's own part (its model, optimizer, buffers). The runtime is estimated as the PSS of the
run's smallest stage process: that stage holds next to nothing of its own (on the tiny
vision-language PPO job the reward function's process, 276 MB, against 290-450 MB for the
others). The broker runs no stage and loads less of torch (~170 MB), so it is kept as measured,
not used as the runtime; so is the local launcher's fork server (`launch/process_start.py`), whose
pages the stage processes it forked share (with it the runtime of a stage process is ~90 MB, the
server ~330 MB: calibrate on a run made the same way as the runs it predicts). A stage's own part
is its processes' PSS less one runtime each. A device group's process carries one runtime plus its
members' own parts. Calibrated with a process per stage, the forwards and the trainers in two groups
predicted against runs so grouped (their processes' peaks summed; the job's peak instant):
    text_ppo, 8 iterations, 8 -> 5 processes   1,546 MB   1,575 and 1,530; 1,532 and 1,496
    the vision-language PPO job, 9 -> 6        2,027 MB   2,071; 1,998

Figures are per-process peaks summed, as if every process peaked at once; a run's job peak (the
largest sum at one instant) is a little lower (2-4% on those jobs), so the prediction errs on the
safe side of a memory limit. PSS divides shared pages among the processes that map them, so a
process left out hands its share of the shared libraries to the others: a group saves somewhat
less than the runtime it removes (text_ppo's groups measured 12 and 20 MB over their prediction).

Device memory (CUDA): each stage's `cuda_peak_allocated_mb` from the memory block; the offload
block (`weights/device_turns.py` counts) gives a stage's cost to bring its state back, onload
seconds per onload, where anything moved (on a CPU device nothing does: 0).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from stream_rlhf.launch.process_start import FORK_SERVER
from stream_rlhf.planner.graph import SimGraph
from stream_rlhf.telemetry.memory import CUDA_PEAK

BROKER = "broker"
NO_STAGE = (BROKER, FORK_SERVER)
"""Processes of a job that run no stage: kept as measured (`other_mb`)."""


@dataclass(frozen=True)
class MemoryProfile:
    runtime_mb: float
    """The host memory every stage process carries: the PSS of the run's smallest stage process."""
    own_mb: dict[str, float]
    """Per stage: the PSS of its processes beyond one runtime each, summed over them."""
    processes: dict[str, int]
    """Per stage: how many processes it ran (instances x ranks)."""
    other_mb: float
    """The processes that run no stage (NO_STAGE: the broker, the fork server), as measured."""
    device_mb: dict[str, float]
    """Per stage that reported one: its peak CUDA allocation."""
    load_s: dict[str, float]
    """Per stage whose offload policy moved anything: seconds per onload."""


NOT_SAMPLED = MemoryProfile(runtime_mb=0.0, own_mb={}, processes={}, other_mb=0.0, device_mb={}, load_s={})
"""A run without a memory block: no host figures, no device memory, free switches."""


def memory_profile(summary: Mapping[str, Any]) -> MemoryProfile | None:
    """The memory of a run of separate stage processes (summary.json's `memory` and `offload`
    blocks); None when its memory was not sampled."""
    per_process = (summary.get("memory") or {}).get("per_process") or {}
    pss = {name: float(figures["peak_pss_mb"]) for name, figures in per_process.items()}
    stage_pss: dict[str, list[float]] = {}
    for name, mb in pss.items():
        if name not in NO_STAGE:
            stage_pss.setdefault(stage_of_process(name), []).append(mb)
    if not stage_pss:
        return None
    runtime = min(mb for figures in stage_pss.values() for mb in figures)
    offload = summary.get("offload") or {}
    return MemoryProfile(
        runtime_mb=runtime,
        own_mb={stage: sum(mb - runtime for mb in figures) for stage, figures in stage_pss.items()},
        processes={stage: len(figures) for stage, figures in stage_pss.items()},
        other_mb=sum(pss.get(name, 0.0) for name in NO_STAGE),
        device_mb={stage: float(mb) for stage, mb in (summary["memory"].get(CUDA_PEAK) or {}).items()},
        load_s={stage: moved["onload_s"] / moved["onloads"] for stage, moved in offload.items()
                if moved.get("onloads") and moved.get("onload_mb", 0) > 0},
    )


def stage_of_process(name: str) -> str:
    """A rank process's stage: "actor_train-0" and "actor_train-1.rank1" -> "actor_train"."""
    instance = name.partition(".")[0]
    return instance.rpartition("-")[0] or instance


def process_memory(graph: SimGraph) -> dict[str, float] | None:
    """Host MB per process of the job (a stage's processes together under its name, a device
    group's under the group's, the ones that run no stage as `other_mb` under "broker"); None
    when unknown."""
    if graph.runtime_mb is None:
        return None
    held: dict[str, float] = {BROKER: graph.other_mb} if graph.other_mb else {}
    for stage in graph.stages:
        if stage.process:
            held[stage.process] = held.get(stage.process, graph.runtime_mb) + stage.host_mb
        else:
            held[stage.name] = stage.processes * graph.runtime_mb + stage.host_mb
    return held
