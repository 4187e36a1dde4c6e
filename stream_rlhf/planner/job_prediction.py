"""The prediction `stream-rlhf plan CONFIG --profile RUN_DIR [--search] [--memory-limit-mb N]` prints
(and, without --profile, `plan CONFIG --search [--device SPEC]`'s from analytic costs: `analytic_costs`).

    profile = job_profile(cfg, stages, Path("runs/calibration"))    # costs from that run's trace
    prediction = predict(profile, cfg.iterations, cfg.schedule, cfg.overlap_depth, cfg.placement.mode,
                         groups, cfg.placement.with_rollout)        # search.py
    plans = search(profile, cfg.iterations, groups=buildable_groups(config, sets, stages),
                   with_rollout=buildable_with_rollout(config, sets, stages))
    kept, dropped = within_memory(plans, limit_mb)
    print(describe(prediction, kept[:3], profile, dropped, limit_mb))

The profile comes from a finished run of the same job (any schedule, overlap depth and iteration
count; a few iterations are enough: `stream-rlhf run CONFIG --set iterations=4`), placed as the
config places it now, with a process per stage: its trace gives each stage's cost (`calibrate.py`),
its summary what each process held (`memory.py`). Its stages' devices are the config's cores
(`driver/dataflow.py` `on_rollout_cores`: `placement.with_rollout` with rollout when separated; a run
whose plan.json put other stages on rollout's cores is refused, naming the `--set` line); their
side for the figures and the sync barriers is the dataflow's (`ROLLOUT_SIDE`). A profile whose
stages differ from the config's (another algorithm, a stage left out or added) is refused, naming
them, except for actor_forward, which overlap_depth >= 1 leaves out (`Profile.for_stages` moves
its cost into actor_train and back); so is a run with device groups, whose step spans include the
turns a stage waited for on its process.
"""

from __future__ import annotations

import json
import logging
import shlex
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from stream_rlhf.config import ConfigError, load_config
from stream_rlhf.driver.dataflow import ROLLOUT_SIDE, lends_idle_cores, on_rollout_cores
from stream_rlhf.launch.plan import Dataflow
from stream_rlhf.planner.calibrate import Profile, profile_from_trace
from stream_rlhf.planner.devices import DeviceFigures, device_figures
from stream_rlhf.planner.job_analytic import job_analytic_profile
from stream_rlhf.planner.memory import BROKER, memory_profile, stage_of_process
from stream_rlhf.planner.rank_search import search_ranks
from stream_rlhf.planner.search import (
    Moved,
    Plan,
    device_group_candidates,
    groups_set,
    with_rollout_candidates,
    with_rollout_set,
)
from stream_rlhf.planner.simulator import Prediction
from stream_rlhf.rl.config import RLJobConfig

log = logging.getLogger(__name__)


def job_profile(cfg: RLJobConfig, stages: set[str], run_dir: Path) -> Profile:
    """The costs of `run_dir`'s trace for the stages `stages` of `cfg`'s plan, and the memory of
    its summary (when it has a memory block)."""
    trace = run_dir / "trace.json"
    if not trace.is_file():
        raise ConfigError(f"--profile {run_dir}: no trace.json there (a finished run of this config with "
                          "trace: true, the default)")
    events = json.loads(trace.read_text())["traceEvents"]
    traced = {e["args"]["stage"] for e in events if e.get("ph") == "X" and e.get("cat") == "step"}
    if (traced ^ stages) - {"actor_forward"}:  # actor_forward alone: Profile.for_stages moves its cost
        raise ConfigError(f"--profile {run_dir}: its stages {sorted(traced)} are not this config's {sorted(stages)} "
                          f"(missing: {sorted(stages - traced)}, extra: {sorted(traced - stages)})")
    hosts = {stage_of_process(e["args"]["name"]) for e in events if e.get("name") == "process_name"}
    if groups := sorted(hosts - traced - {BROKER}):
        raise ConfigError(f"--profile {run_dir}: processes {groups} each ran several stages (device groups), whose "
                          "steps include waiting for their turn; calibrate on a run with a process per stage")
    _check_run_sides(cfg, stages, run_dir)
    if cfg.placement.mode == "colocated":
        devices = {stage: "all cores" for stage in traced}
    else:
        devices = {stage: "rollout cores" if on_rollout_cores(cfg, stage) else "train cores" for stage in traced}
    try:
        profile = profile_from_trace(events, devices, ROLLOUT_SIDE & stages,
                                     lending=lends_idle_cores(cfg)).for_stages(stages)
    except ValueError as exc:
        raise ConfigError(f"--profile {run_dir}: {exc}") from exc
    summary = run_dir / "summary.json"
    return replace(profile, memory=memory_profile(json.loads(summary.read_text()))) if summary.is_file() else profile


def _check_run_sides(cfg: RLJobConfig, stages: set[str], run_dir: Path) -> None:
    """Refuse a separated run (its plan.json) that put other stages on rollout's cores than `cfg`
    does: the profile reads each stage's device from the config (`on_rollout_cores`)."""
    sides = planned_on_rollout_cores(run_dir)
    if cfg.placement.mode != "separated" or sides is None or all(sides.get(stage, True) for stage in stages):
        return  # unknown, unpinned, or every stage on one set of cores
    ran = sorted(stage for stage in stages - ROLLOUT_SIDE if sides.get(stage))
    configured = sorted(stage for stage in stages - ROLLOUT_SIDE if stage in sides and on_rollout_cores(cfg, stage))
    if ran != configured:
        raise ConfigError(f"--profile {run_dir}: the run had {ran or 'no stage'} on rollout's cores, this config "
                          f"{configured or 'none'}; calibrate on a run placed as the config is, or give "
                          f"--set '{with_rollout_set(tuple(ran))}' as that run had it")


def planned_on_rollout_cores(run_dir: Path) -> dict[str, bool] | None:
    """Per stage of the run's plan.json, whether its (first) rank had rollout's cores; None without a
    plan or with rollout not pinned to cores."""
    plan = run_dir / "plan.json"
    cores: dict[str, tuple[int, ...]] = {}
    for rank in json.loads(plan.read_text()).get("ranks", []) if plan.is_file() else []:
        cores.setdefault(rank["stage"], tuple(rank.get("cores") or ()))
    rollout = cores.get("rollout")
    return {stage: on == rollout for stage, on in cores.items()} if rollout else None


def buildable_groups(config: str, sets: list[str], stages: set[str]) -> list[dict[str, list[str]]]:
    """The device groups the search tries (`device_group_candidates`) that this config accepts
    with `sets` (a member with several ranks, another backend or cores of its own rules one out),
    with no stage on rollout's cores (the search pairs them with `with_rollout`; `search.fits`)."""
    return [groups for groups in device_group_candidates(stages)
            if _builds(config, [*sets, "placement.with_rollout=[]"], groups_set(groups))]


def buildable_with_rollout(config: str, sets: list[str], stages: set[str]) -> list[Moved]:
    """The stages on rollout's cores the search tries (`with_rollout_candidates`) that this config
    accepts, separated and without device groups, with `sets` (the search pairs them with the
    groups; `search.fits`)."""
    base = [*sets, "placement.mode=separated", "placement.device_groups={}"]
    return [moved for moved in with_rollout_candidates(stages) if _builds(config, base, with_rollout_set(moved))]


def _builds(config: str, sets: list[str], line: str) -> bool:
    """Whether `config` loads with `sets` and then `line` (why not is logged)."""
    try:
        load_config(RLJobConfig, config, [*sets, line])
    except ConfigError as exc:
        log.info("plan --search: %s does not fit this config: %s", line, exc)
        return False
    return True


def analytic_costs(cfg: RLJobConfig, flow: Dataflow, device_spec: str | None, prompt_tokens: float | None,
                   response_tokens: float | None, groups: list[dict[str, list[str]]] | None,
                   with_rollout: list[Moved] | None = None) -> tuple[Profile, DeviceFigures, list[Plan]]:
    """The analytic profile of `cfg` (`job_analytic.py`) on `device_spec` (None: this machine),
    the figures used, and with `groups` (the device groups to try) the plans of a search over
    schedules, placements and ranks (`rank_search.py`), best first; without: no plans."""
    device = device_figures(device_spec) if device_spec is not None else None
    profile, device = job_analytic_profile(cfg, flow, device, prompt_tokens, response_tokens)
    if groups is None:
        return profile, device, []

    def profile_of(ranks: Mapping[str, int]) -> Profile:
        return job_analytic_profile(cfg, flow, device, prompt_tokens, response_tokens, dict(ranks))[0]

    return profile, device, search_ranks(profile_of, device.count, cfg.iterations, groups=groups,
                                         with_rollout=with_rollout)


def describe_device(device: DeviceFigures) -> str:
    return f"costs: analytic (planner/analytic.py), from {device.describe()}"


def plan_dict(plan: Plan) -> dict[str, Any]:
    return {"sets": plan.sets, **({"ranks": dict(plan.ranks)} if plan.ranks else {}), **plan.prediction.summary()}


def describe(prediction: Prediction, plans: list[Plan], profile: Profile, dropped: int = 0,
             limit_mb: float | None = None) -> str:
    lines = [f"predicted (profile: contention {profile.contention:.2f}, {_lending(profile)}, weights publish "
             f"{profile.publish_s:.3f} s, load {profile.weights_load_s:.3f} s{_runtime(profile)}):",
             f"  iteration {prediction.iteration_s:.3f} s, bubble ratio {_bubble(prediction)}, "
             f"max staleness {prediction.staleness_max}, peak memory {_memory(prediction)}"]
    if limit_mb is not None:
        lines.append(f"{dropped} plan(s) left out: predicted over --memory-limit-mb {limit_mb:g}")
    if plans:
        lines.append("best plans (predicted iteration s, peak memory MB, bubble ratio; --set lines):")
        lines += [f"  {p.prediction.iteration_s:8.3f}  {_memory(p.prediction, unit=False):>8}  "
                  f"{_bubble(p.prediction):>6}  " + " ".join(f"--set {shlex.quote(s)}" for s in p.sets) for p in plans]
    return "\n".join(lines)


def _lending(profile: Profile) -> str:
    if not profile.alone_speedup:
        return "no speed-up alone with lent cores fitted"
    return "alone with lent cores " + ", ".join(f"{stage} {s:.2f}x" for stage, s in profile.alone_speedup.items())


def _runtime(profile: Profile) -> str:
    if profile.memory is None:
        return "; no memory figures"
    return f"; runtime {profile.memory.runtime_mb:.0f} MB per process"


def _memory(prediction: Prediction, unit: bool = True) -> str:
    if prediction.peak_host_mb is None:
        return "n/a"
    return f"{prediction.peak_host_mb:.0f}" + (" MB (host, the processes' peaks summed)" if unit else "")


def _bubble(prediction: Prediction) -> str:
    return "n/a" if prediction.figures is None else f"{prediction.figures.bubble_ratio:.3f}"
