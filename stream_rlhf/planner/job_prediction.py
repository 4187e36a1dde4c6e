"""The prediction `stream-rlhf plan CONFIG --profile RUN_DIR [--search]` prints.

    profile = job_profile(cfg, stages, Path("runs/calibration"))    # costs from that run's trace
    prediction = predict(profile, cfg.iterations, cfg.schedule, cfg.overlap_depth, cfg.placement.mode)  # search.py
    print(describe(prediction, search(profile, cfg.iterations)[:3], profile))

The profile comes from a finished run of the same job (any schedule, overlap depth and iteration
count; a few iterations are enough: `stream-rlhf run CONFIG --set iterations=4`), placed as the
config places it now: its trace gives each stage's cost (`calibrate.py`). A profile whose stages
differ from the config's (another algorithm, a stage left out or added) is refused, naming them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from stream_rlhf.config import ConfigError
from stream_rlhf.planner.calibrate import Profile, profile_from_trace
from stream_rlhf.planner.search import Plan
from stream_rlhf.planner.simulator import Prediction
from stream_rlhf.rl.config import RLJobConfig
from stream_rlhf.rl.dataflow import ROLLOUT_SIDE


def job_profile(cfg: RLJobConfig, stages: set[str], run_dir: Path) -> Profile:
    """The costs of `run_dir`'s trace for the stages `stages` of `cfg`'s plan."""
    trace = run_dir / "trace.json"
    if not trace.is_file():
        raise ConfigError(f"--profile {run_dir}: no trace.json there (a finished run of this config with "
                          "trace: true, the default)")
    events = json.loads(trace.read_text())["traceEvents"]
    traced = {e["args"]["stage"] for e in events if e.get("ph") == "X" and e.get("cat") == "step"}
    if traced != stages:
        raise ConfigError(f"--profile {run_dir}: its stages {sorted(traced)} are not this config's {sorted(stages)} "
                          f"(missing: {sorted(stages - traced)}, extra: {sorted(traced - stages)})")
    side = ROLLOUT_SIDE & stages
    if cfg.placement.mode == "colocated":
        devices = {stage: "all cores" for stage in stages}
    else:
        devices = {stage: "rollout cores" if stage in side else "train cores" for stage in stages}
    try:
        return profile_from_trace(events, devices, side)
    except ValueError as exc:
        raise ConfigError(f"--profile {run_dir}: {exc}") from exc


def plan_dict(plan: Plan) -> dict[str, Any]:
    return {"sets": plan.sets, **plan.prediction.summary()}


def describe(prediction: Prediction, plans: list[Plan], profile: Profile) -> str:
    lines = [f"predicted (profile: contention {profile.contention:.2f}, weights publish {profile.publish_s:.3f} s, "
             f"load {profile.weights_load_s:.3f} s):",
             f"  iteration {prediction.iteration_s:.3f} s, bubble ratio {_bubble(prediction)}, "
             f"max staleness {prediction.staleness_max}"]
    if plans:
        lines.append("best plans (predicted iteration s, bubble ratio; --set lines):")
        lines += [f"  {p.prediction.iteration_s:8.3f}  {_bubble(p.prediction):>6}  "
                  + " ".join(f"--set {s}" for s in p.sets) for p in plans]
    return "\n".join(lines)


def _bubble(prediction: Prediction) -> str:
    return "n/a" if prediction.figures is None else f"{prediction.figures.bubble_ratio:.3f}"
