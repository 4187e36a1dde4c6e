"""`placement: auto`: the placement a job runs with, chosen for its workload before the stages start.

    choice = choose_placement(cfg, flow, device=None)   # device None: this machine (timed once, cached)
    cfg = with_placement(cfg, choice.chosen)             # the keys left to auto, set
    print(choice.describe())                             # what, why, the predicted iteration time
    drift = replan(cfg, flow, choice, response_tokens=31.5, measured_iteration_s=0.9, iterations=5)

Only the keys the config leaves to `auto` (`PlacementConfig.auto`: mode, with_rollout,
device_groups) are chosen; a key given explicitly keeps its value and pins that axis. The
candidates are the search's (`search.py` `placement_candidates`: mode x the train-side stages on
rollout's cores, with the config's device groups or, left to auto, none: on the CPU a group
changes no step's time, its stages take turns on their side's cores already). Each is built as
a config (one the config refuses is left out, with the reason), checked against this machine's cores and devices
(`driver/dataflow.py` `check_placement`) and against memory (the models each device set holds:
a forward's weights, a trainer's weights, gradients and Adam's moments; on the CPU one pool, the
host's). The simulator predicts each one's iteration time from analytic costs of the workload
(`job_analytic.py`: the model's size, prompt and answer lengths, rows and mini-batches, the
trainers' passes) on this machine's figures (`micro_calibration.py`: a timed probe of the job's
model shape, ~1-5 s, cached per host and shape), under the config's schedule and overlap_depth,
which auto does not change, over at least `MIN_PREDICTED_ITERATIONS`. The fastest wins; ties go
to the earlier candidate (no groups, fewer stages moved). The answer length is
`rollout.max_new_tokens`: an upper bound when responses stop at <eos>; `replan` compares it with what the run measures.

Given a config and the device figures the choice is deterministic (the figures are this
machine's description: cached, so a later plan or run of the same job reads the same ones).
Not chosen: ranks and rollout instances (one device per side on the CPU: the rank axis has one
point), anything on CUDA, where the figures would be the CPU's, and a Ray job whose
`ray.stage_resources` pin stages to nodes: there auto keeps the fallback (`AUTO_FALLBACK`) and says so.
"""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass, replace
from typing import Any

from stream_rlhf.config import ConfigError
from stream_rlhf.driver.dataflow import ROLLOUT_SIDE, check_placement, device_groups
from stream_rlhf.launch.placement import AUTO_FALLBACK
from stream_rlhf.launch.plan import Dataflow
from stream_rlhf.planner.analytic import Workload
from stream_rlhf.planner.calibrate import Profile
from stream_rlhf.planner.devices import DeviceFigures
from stream_rlhf.planner.job_analytic import (
    job_analytic_profile,
    job_workload,
    model_shape,
    planned_response_tokens,
)
from stream_rlhf.planner.search import (
    MODES,
    devices_of,
    placement_candidates,
    predict,
    with_rollout_candidates,
)
from stream_rlhf.rl.config import RLJobConfig
from stream_rlhf.rl.stage_kinds import STAGE_KINDS

MIN_PREDICTED_ITERATIONS = 40
"""Candidates are predicted over the config's iterations, at least this many: a placement that
overloads one side builds a backlog that slows each iteration more than the last, which a short
horizon hides (text_ppo's forwards on rollout's cores: predicted best over 10-20 iterations,
fourth over 45)."""
TRAINER_BYTES = 16
"""Bytes a trainer holds per weight: weights, gradients and Adam's two moments, fp32."""


@dataclass(frozen=True)
class Candidate:
    placement: dict[str, Any]
    """mode, with_rollout and device_groups as this candidate runs them."""
    iteration_s: float | None
    """Predicted seconds per iteration; None: left out (`left_out` says why)."""
    left_out: str = ""


@dataclass(frozen=True)
class PlacementChoice:
    decided: tuple[str, ...]
    """The keys auto chose (those the config left to it)."""
    placement: dict[str, Any]
    """mode, with_rollout and device_groups as the job runs them."""
    predicted_iteration_s: float | None
    why: str
    candidates: tuple[Candidate, ...]
    workload: Workload | None
    """The workload costed (None: nothing was predicted, `why` says why)."""
    device: DeviceFigures | None
    """The figures the costs came from (None: nothing was predicted)."""

    @property
    def chosen(self) -> dict[str, Any]:
        """The decided keys' values."""
        return {key: self.placement[key] for key in self.decided}

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready (plan.json's and summary.json's `placement_auto`), with `describe` as `summary`."""
        return {"summary": self.describe(), "decided": list(self.decided), "placement": self.placement,
                "predicted_iteration_s": _round(self.predicted_iteration_s), "why": self.why,
                "workload": None if self.workload is None else asdict(self.workload),
                "device": None if self.device is None else asdict(self.device),
                "candidates": [{**c.placement, "predicted_iteration_s": _round(c.iteration_s)}
                               | ({"left_out": c.left_out} if c.left_out else {}) for c in self.candidates]}

    def describe(self) -> str:
        chosen = ", ".join(f"{key}={_flow(value)}" for key, value in self.chosen.items())
        return f"placement auto: {chosen or 'nothing left to auto'}: {self.why}"


def choose_placement(cfg: RLJobConfig, flow: Dataflow, device: DeviceFigures | None = None,
                     decided: tuple[str, ...] | None = None, response_tokens: float | None = None) -> PlacementChoice:
    """The placement of `cfg`'s keys `decided` (None: those it leaves to auto) for its workload
    (`response_tokens`: the answer length, default `rollout.max_new_tokens`) on `device` (None:
    this machine's figures); module docstring."""
    decided = cfg.placement.auto if decided is None else decided
    stages = sorted(flow.stages)
    current = {"mode": cfg.placement.mode, "with_rollout": list(cfg.placement.with_rollout),
               "device_groups": device_groups(cfg, stages)}
    if not decided:
        return PlacementChoice((), current, None, "every placement key given", (), None, device)
    fallback = {**current, **{key: copy.deepcopy(AUTO_FALLBACK[key]) for key in decided}}
    if "mode" not in decided and ("with_rollout" not in decided or current["mode"] == "colocated"):
        unused = "given" if "with_rollout" not in decided else "not used when colocated"
        return PlacementChoice(decided, fallback, None, f"nothing to predict: mode is given, with_rollout {unused}, "
                               "and a device group changes no step's time (its stages take turns on their cores "
                               "already; on CUDA it saves device memory: give device_groups)", (), None, device)
    if cfg.placement.resolved_device() == "cuda":
        why = ("on CUDA the analytic figures would be this machine's CPU's: the fallback is kept "
               "(`stream-rlhf plan --search --device h100,count=N` compares placements on a GPU preset)")
        return PlacementChoice(decided, fallback, None, why, (), None, device)
    if cfg.launcher == "ray" and cfg.ray.stage_resources:
        why = ("the fallback is kept: ray.stage_resources places stages on nodes, which moving a stage to "
               "rollout's cores would contradict; give the placement keys")
        return PlacementChoice(decided, fallback, None, why, (), None, device)
    try:
        work = job_workload(cfg, response_tokens=response_tokens)
    except ConfigError as exc:
        return PlacementChoice(decided, fallback, None, f"the fallback is kept: the prompts' length is not known "
                               f"({exc}); give the placement keys", (), None, device)
    profile, device = job_analytic_profile(cfg, flow, device, response_tokens=response_tokens)
    modes = MODES if "mode" in decided else (current["mode"],)
    groups = [{}] if "device_groups" in decided else [current["device_groups"]]  # on the CPU: none (docstring)
    moves = with_rollout_candidates(stages) if "with_rollout" in decided else [tuple(current["with_rollout"])]
    candidates = []
    for grouping, mode, moved in placement_candidates(groups, modes, moves):
        placement = {"mode": mode, "with_rollout": list(moved),
                     "device_groups": {name: list(members) for name, members in grouping.items()}}
        left_out = _cannot_run(cfg, placement, profile, device)
        horizon = max(cfg.iterations, MIN_PREDICTED_ITERATIONS)
        seconds = None if left_out else predict(profile, horizon, cfg.schedule, cfg.overlap_depth, mode, grouping,
                                                moved).iteration_s
        candidates.append(Candidate(placement, seconds, left_out))
    ranked = sorted((c for c in candidates if c.iteration_s is not None), key=lambda c: round(c.iteration_s, 9))
    if not ranked:
        raise ConfigError("placement: auto: no placement fits this machine: "
                          + "; ".join(f"{_flow(c.placement)}: {c.left_out}" for c in candidates))
    best = ranked[0]
    return PlacementChoice(decided, best.placement, best.iteration_s, _why(cfg, profile, work, ranked),
                           tuple(candidates), work, device)


def with_placement(cfg: RLJobConfig, chosen: dict[str, Any]) -> RLJobConfig:
    """`cfg` with the placement keys `chosen` set (the config's checks run again)."""
    return replace(cfg, placement=replace(cfg.placement, **chosen))


def replan(cfg: RLJobConfig, flow: Dataflow, choice: PlacementChoice, response_tokens: float,
           measured_iteration_s: float, iterations: int, force: bool = False) -> dict[str, Any]:
    """After `iterations` measured ones: the prediction again at the measured answer length, and
    the placement predicted faster than the running one by `placement.replan_margin`, if any
    (None under `better`). `force`: the fastest other placement counts as better whatever its
    prediction (a test seam, `driver/replan.py`)."""
    again = choose_placement(cfg, flow, choice.device, choice.decided, response_tokens)
    running = next((c.iteration_s for c in again.candidates if c.placement == choice.placement), None)
    margin = cfg.placement.replan_margin
    others = sorted((c for c in again.candidates if c.iteration_s is not None and c.placement != choice.placement),
                    key=lambda c: round(c.iteration_s, 9))
    better = None
    if running is not None and others and (force or others[0].iteration_s < running * (1 - margin)):
        better = {**{k: others[0].placement[k] for k in choice.decided},
                  "predicted_iteration_s": _round(others[0].iteration_s)}
    return {"after_iterations": iterations, "measured_iteration_s": _round(measured_iteration_s),
            "predicted_iteration_s": _round(choice.predicted_iteration_s),
            "response_tokens": {"planned": choice.workload.response_tokens, "measured": round(response_tokens, 2)},
            "running_predicted_now_s": _round(running), "margin": margin, "better": better}


def describe_replan(drift: dict[str, Any]) -> str:
    """The log line of `replan`'s result."""
    tokens = drift["response_tokens"]
    head = (f"placement re-plan after {drift['after_iterations']} iterations: measured "
            f"{drift['measured_iteration_s']} s per iteration (predicted {drift['predicted_iteration_s']} s), "
            f"answers {tokens['measured']} tokens "
            f"(planned {tokens['planned']:g})")
    better = drift["better"]
    if better is None:
        return f"{head}; no other placement predicted {drift['margin']:.0%} faster"
    sets = " ".join(f"--set placement.{k}={_flow(v)}" for k, v in better.items() if k != "predicted_iteration_s")
    return (f"{head}; another placement is predicted {better['predicted_iteration_s']} s against "
            f"{drift['running_predicted_now_s']} s for the running one: {sets}")


def _cannot_run(cfg: RLJobConfig, placement: dict[str, Any], profile: Profile, device: DeviceFigures) -> str:
    """Why `placement` cannot run this job here ("" when it can)."""
    try:
        placed = with_placement(cfg, placement)
        check_placement(placed, sorted(profile.step_s))
    except ConfigError as exc:
        return str(exc)
    on_cpu = placed.placement.resolved_device() == "cpu"
    sets = devices_of(profile, placement["mode"], placement["with_rollout"])
    pools: dict[str, float] = {}
    params = model_shape(cfg).params
    for stage, where in sets.items():
        kind = STAGE_KINDS.get(stage)
        if stage == "rollout" or (kind is not None and kind.groupable):
            held = params * (TRAINER_BYTES if kind is not None and kind.trains else device.bytes_per_param)
            pool = "host" if on_cpu else where
            pools[pool] = pools.get(pool, 0.0) + held / 1e9
    over = {pool: gb for pool, gb in pools.items() if gb > device.memory_gb}
    return "; ".join(f"{pool}: its models need {gb:.1f} GB, {device.memory_gb:g} GB there" for pool, gb in over.items())


def _why(cfg: RLJobConfig, profile: Profile, work: Workload, ranked: list[Candidate]) -> str:
    """The choice in a sentence: the workload, the two sides' work, the best and the next best."""
    rollout_s = sum(sum(cost) for stage, cost in profile.step_s.items() if stage in ROLLOUT_SIDE)
    train_s = sum(sum(cost) for stage, cost in profile.step_s.items() if stage not in ROLLOUT_SIDE)
    planned, source = planned_response_tokens(cfg, work.prompt_tokens)
    source = source if work.response_tokens == planned else "measured"
    text = (f"answers of {work.response_tokens:g} tokens ({source}), prompts of "
            f"{work.prompt_tokens:.1f}, {work.minibatches} mini-batches of {work.rows} rows: generation "
            f"~{rollout_s:.3f} s and forwards + training ~{train_s:.3f} s an iteration; predicted "
            f"{ranked[0].iteration_s:.3f} s per iteration under {cfg.schedule} (overlap_depth {cfg.overlap_depth})")
    slower = [c for c in ranked if round(c.iteration_s, 9) > round(ranked[0].iteration_s, 9)]
    if slower:
        runner_up = slower[0]
        differs = {k: v for k, v in runner_up.placement.items() if ranked[0].placement[k] != v}
        text += f", the next best ({_flow(differs)}) {runner_up.iteration_s:.3f} s"
    return text


def _flow(value: Any) -> str:
    """A value as YAML's flow style writes it (what --set takes)."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_flow(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list | tuple):
        return "[" + ", ".join(map(_flow, value)) + "]"
    return str(value)


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)
