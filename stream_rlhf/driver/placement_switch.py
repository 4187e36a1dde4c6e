"""The switch to another placement while a job runs (`placement.replan: switch`).

    restart_s = restart_estimate(records, first_record_s=6.1)                # ReplanWatch, after the re-plan
    decision = decide(cfg, drift, done=7, restart_s=restart_s, switched_before=False)
    switch = planned_switch(choice, drift)       # when decision.switch; then the watch drains the stages
    ... the stages drain; the trainers checkpoint the iteration they reached ...
    cfg = switched_config(cfg, run_dir, switch, point)   # the driver: logged, recorded, the next leg's config

The driver then prepares the job again with `resume` from that checkpoint and the new placement
(`commands/run.py`'s run loop), and it trains on to the configured iterations.

Why drain at once instead of waiting for the next `checkpoint.every` boundary: a drain is a
checkpoint boundary of its own. The trainers catch up with each other and save the iteration they
reached (`stages/trainer_checkpoint.py` save_at_stop), the path of `SIGTERM` + `--resume`, whose
tests hold it exact: no sample lost or trained twice, since rollout's outputs after the
checkpoint are kept and trained as they are. Waiting would only run more iterations at the
slower placement and then drain all the same.

When (`decide`): the re-plan named a faster placement (`planner/auto_placement.py` replan),
`placement.replan` is `switch`, the run has not switched before (at most `MAX_SWITCHES` a run),
at least `MIN_ITERATIONS_LEFT` iterations are left, and the gain predicted over them outweighs
a restart. The gain is the predicted seconds saved per iteration, scaled to this run's measured
iteration time (measured / predicted for the running placement), times the iterations left. The
restart's cost is estimated from this job's own start (`restart_estimate`): the seconds from its
processes' start to its first trained iteration, less a steady iteration. That is process
start-up, model builds and first compiles, which a restart pays again (the resumed leg skips the
warm start and the eval before).

`summary.json` (`placement`, `driver/run.py`) lists the placements used and the switches, from
`checkpoints/run.json` (`driver/resume.py` append_switch), so a run resumed after its switch still
says so.
"""

from __future__ import annotations

import logging
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stream_rlhf.config import ConfigError
from stream_rlhf.driver.resume import append_switch
from stream_rlhf.resume.store import ResumePoint
from stream_rlhf.rl.config import RLJobConfig

if TYPE_CHECKING:
    from stream_rlhf.planner.auto_placement import PlacementChoice

log = logging.getLogger("stream_rlhf")
MAX_SWITCHES = 1
"""Switches a run makes at most: the re-plan runs once, on the first placement's iterations."""
MIN_ITERATIONS_LEFT = 2
"""Iterations that must be left after those trained for a switch: the drain finishes the one in flight."""


@dataclass(frozen=True)
class Decision:
    switch: bool
    why: str


@dataclass(frozen=True)
class PlannedSwitch:
    """A switch the re-plan asked for; the iteration it happens at is the drain's checkpoint."""

    from_placement: dict[str, Any]
    """mode, with_rollout and device_groups as the job ran them."""
    to_placement: dict[str, Any]
    chosen: dict[str, Any]
    """The keys auto decides, as the next leg sets them (`with_placement`)."""
    predicted_from_s: float
    """The running placement's predicted seconds per iteration at the measured answer length."""
    predicted_to_s: float
    auto: dict[str, Any]
    """The first choice (`PlacementChoice.as_dict`), kept for the summary of the legs after it."""
    replan: dict[str, Any]
    """The re-plan's figures that led to the switch."""

    def describe(self, iteration: int | None = None) -> str:
        """The log line of the switch at `iteration` (None: when it is decided, before the drain)."""
        at = "at the next iteration boundary" if iteration is None else f"at iteration {iteration}"
        return (f"placement: switching {at} from {describe_placement(self.from_placement)} to "
                f"{describe_placement(self.to_placement)} "
                f"(predicted {self.predicted_to_s} s/iter vs {self.predicted_from_s})")


def restart_estimate(records: list[dict[str, Any]], first_record_s: float | None) -> float:
    """Seconds a restart of the job costs, from metrics.jsonl's first `records` and
    `first_record_s`, the seconds from the processes' start to the first record (None: not seen,
    then the first iteration's excess over the others)."""
    measured = statistics.fmean(r["iteration_s"] for r in records[1:] or records)
    if first_record_s is not None:
        return max(0.0, first_record_s - measured)
    return max(0.0, records[0]["iteration_s"] - measured) if len(records) > 1 else measured


def decide(cfg: RLJobConfig, drift: dict[str, Any], done: int, restart_s: float, switched_before: bool,
           forced: bool = False) -> Decision:
    """Whether the re-plan's `drift` (`auto_placement.replan`) switches the job now, `done`
    iterations trained, a restart costing `restart_s`; module docstring. `forced`: a named
    placement is switched to whatever the gain (a test seam, `driver/replan.py`)."""
    better = drift["better"]
    if better is None:
        return Decision(False, "no faster placement")
    if cfg.placement.replan == "warn":
        return Decision(False, "placement.replan=warn (a later run chooses again; switch: moves this one)")
    if switched_before:
        return Decision(False, f"this run switched placement already (at most {MAX_SWITCHES} a run)")
    left = cfg.iterations - done
    if left < MIN_ITERATIONS_LEFT:
        return Decision(False, f"{left} of iterations={cfg.iterations} left: too few to switch")
    measured = drift["measured_iteration_s"]
    scale = measured / drift["running_predicted_now_s"]
    gain_s = (drift["running_predicted_now_s"] - better["predicted_iteration_s"]) * scale * left
    figures = (f"predicted gain {gain_s:.1f} s over the {left} iterations left, a restart ~{restart_s:.1f} s "
               "(this job's start-up)")
    if forced:
        return Decision(True, f"forced by the test hook; {figures}")
    if gain_s <= restart_s:
        return Decision(False, f"the gain does not pay for a restart: {figures}")
    return Decision(True, figures)


def planned_switch(choice: PlacementChoice, drift: dict[str, Any]) -> PlannedSwitch:
    """The switch to the placement `drift` names as better, from `choice`'s."""
    chosen = {key: value for key, value in drift["better"].items() if key != "predicted_iteration_s"}
    return PlannedSwitch(choice.placement, {**choice.placement, **chosen}, chosen, drift["running_predicted_now_s"],
                         drift["better"]["predicted_iteration_s"], choice.as_dict(), drift)


def switched_config(cfg: RLJobConfig, run_dir: Path, switch: PlannedSwitch, point: ResumePoint | None) -> RLJobConfig:
    """After the drain: the switch logged and recorded in run.json at `point` (the checkpoint the
    drain left), and `cfg` with the new placement for the leg that resumes from it."""
    from stream_rlhf.planner.auto_placement import with_placement

    if point is None:
        raise ConfigError(f"placement.replan=switch: the stages drained to switch placement but left no complete "
                          f"checkpoint in {run_dir} to resume from")
    log.warning("%s", switch.describe(point.version))
    append_switch(run_dir, {"iteration": point.version, "from": switch.from_placement, "to": switch.to_placement,
                            "predicted_iteration_s": {"from": switch.predicted_from_s, "to": switch.predicted_to_s},
                            "auto": switch.auto, "replan": switch.replan})
    return with_placement(cfg, switch.chosen)


def placements_used(running: dict[str, Any], switches: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """summary.json's `placement.used`: each placement the run trained under, from which iteration."""
    if not switches:
        return [{"from_iteration": 0, **running}]
    return [{"from_iteration": 0, **switches[0]["from"]}] + [{"from_iteration": s["iteration"], **s["to"]}
                                                              for s in switches]


def describe_placement(placement: dict[str, Any]) -> str:
    """A placement as the log says it: the mode, with_rollout when separated, device groups if any."""
    text = placement["mode"]
    if placement["mode"] == "separated":
        text += f" with_rollout=[{', '.join(placement['with_rollout'])}]"
    groups = placement["device_groups"]
    if groups:
        text += " device_groups={" + ", ".join(f"{g}: [{', '.join(m)}]" for g, m in groups.items()) + "}"
    return text
