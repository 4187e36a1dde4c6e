"""An RL job's plan (`launch/plan.py`), compiled once, in the driver.

    cfg, choice = auto_placed(cfg, checkpoint, weights_root, vision_language)   # `placement: auto`'s keys
    plan = compile_plan(cfg, checkpoint, weights_root, vision_language,
                        placement_auto=choice.as_dict())  # after the driver's warm start
    plan = preview_plan(cfg)      # `stream-rlhf plan` and `stage`: nothing written, trained or started

`auto_placed` chooses the placement keys the config leaves to `auto` (`planner/auto_placement.py`,
imported where it is used: the planner builds on the driver's dataflow) from the dataflow of the
config's fallback placement; the plan records the choice (`placement_auto`).

`preview_plan` finds the dataset and the warm-start checkpoint where the driver puts them without
making either: `stream-rlhf plan` says whether they are there yet, `stream-rlhf stage` refuses to
start a rank before the driver made them (each stage process used to warm-start on its own).

A plan that spans hosts (`JobPlan.spans_hosts`) carries CURVE keys: those of `broker.curve.key_dir`
when the config names a folder, else a pair the driver makes. Under `ray.node_hosts`, when rollout
and actor_train are not pinned to the same nodes (`ray.stage_resources`), the weights travel by the
broadcast group instead of the shared-memory store, which is one host's; the critic's versions go
to critic_forward by a broadcast group of their own (`stages/critic_weights.py`).

A rank on another host than the driver's gets its spec through `on_host` (the plan's `relocate`):
its job writes into that host's run folder (shipped into the driver's) and keeps its weight
versions in that host's store. Stages that still meet through one host's store are listed in the
plan's `same_host` (the launcher refuses to split them). A resumed run's ranks there read their
checkpoint from that host's run folder: the launcher copies what each stage reads into it first
(`driver/resume.py` `resume_inputs`, the plan's `host_inputs`).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from stream_rlhf.broker.sockets import CurveKeys
from stream_rlhf.config import ConfigError
from stream_rlhf.driver.dataflow import compile_job
from stream_rlhf.launch.placement import machine_cores
from stream_rlhf.launch.plan import JobPlan
from stream_rlhf.launch.spec import StageSpec
from stream_rlhf.resume.store import FOLDER, ResumePoint
from stream_rlhf.rl.config import RLJobConfig
from stream_rlhf.stages.job_context import JobContext
from stream_rlhf.weights.shm_store import weights_root
from stream_rlhf.weights.transport import TRANSPORTS

if TYPE_CHECKING:
    from stream_rlhf.planner.auto_placement import PlacementChoice


def compile_plan(cfg: RLJobConfig, checkpoint: str, weights: str, vision_language: bool,
                 resume: ResumePoint | None = None, checkpoint_ready: bool = True,
                 dataset_ready: bool = True, dataset: dict[str, str] | None = None,
                 placement_auto: dict[str, Any] | None = None) -> JobPlan:
    """The plan of `cfg` (its data already resolved, or `dataset`: the files still to write)
    starting from `checkpoint`; `placement_auto`: what auto chose (`auto_placed`), recorded."""
    cfg, weights_check = _weights_across_hosts(cfg)
    flow = compile_job(cfg, checkpoint, weights, vision_language, resume)
    if dataset is None and cfg.data.train is not None:
        dataset = {"train": cfg.data.train, **({"eval": cfg.data.eval} if cfg.data.eval else {})}
    elif dataset is None:
        dataset = {"task": f"{cfg.task.name} (made in memory by each stage)"}
    devices = sorted({s.device(r) for s in flow.stages.values() for r in range(s.ranks) if s.device(r) != "cpu"})
    present = torch.cuda.device_count() if torch.cuda.is_available() else 0
    checks = [f"driver machine: placement cores within the available {machine_cores()}",
              f"driver machine: CUDA devices {', '.join(devices) or 'none'} needed, {present} present"]
    if cfg.launcher == "ray":
        pinning = ("ranks keep the plan's cores (a Ray instance of this machine)" if cfg.ray.own_instance
                   else "ranks are not pinned to cores, their cpus are the bundle's")
        checks.append(f"ray: every bundle must fit a node of the cluster within ray.start_timeout_s="
                      f"{cfg.ray.start_timeout_s:g} (checked when the placement group is made); {pinning}")
    plan = JobPlan(cfg.name, flow, cfg.launcher, cfg.ray, checkpoint, checkpoint_ready, dataset, dataset_ready,
                   checks, run_dir=str(Path(cfg.run_dir).resolve()), weights_root=weights,
                   relocate="stream_rlhf.driver.plan:on_host", host_inputs="stream_rlhf.driver.resume:resume_inputs",
                   same_host=_same_host(cfg, flow.stages),
                   placement_auto=placement_auto)
    if not plan.spans_hosts:
        return plan
    curve = cfg.broker.curve
    keys = ("across hosts: the broker and payload servers use CURVE keys "
            + (f"from broker.curve.key_dir={curve.key_dir}" if curve else "the driver made for this run")
            + ", handed to every rank")
    checks = [*checks, keys, *([weights_check] if weights_check else [])]
    if "critic_forward" in flow.stages:
        checks.append("across hosts: each critic version goes to critic_forward by a broadcast group "
                      "(stages/critic_weights.py)")
    return replace(plan, flow=flow, keys=CurveKeys.read(curve.key_dir) if curve else CurveKeys.generate(),
                   checks=checks)


def auto_placed(cfg: RLJobConfig, checkpoint: str, weights: str,
                vision_language: bool) -> tuple[RLJobConfig, PlacementChoice | None]:
    """`cfg` with the placement keys it leaves to `auto` chosen, and the choice (None: it leaves none)."""
    if not cfg.placement.auto:
        return cfg, None
    from stream_rlhf.planner.auto_placement import choose_placement, with_placement

    choice = choose_placement(cfg, compile_job(cfg, checkpoint, weights, vision_language))
    return with_placement(cfg, choice.chosen), choice


def on_host(spec: StageSpec, run_dir: str, weights_root: str | None) -> StageSpec:
    """A stage's spec for a rank on another host than the driver's: its job writes into `run_dir`
    (that host's run folder) and keeps its weight versions in `weights_root`."""
    job: JobContext = spec.kwargs["job"]
    folder = Path(run_dir)
    if folder.name != job.config.name:
        raise ValueError(f"on_host: run folder {run_dir} is not named after job {job.config.name}")
    if job.resume is not None:  # its files are copied there first (`resume_inputs`)
        job = replace(job, resume=ResumePoint(job.resume.version, folder / FOLDER / job.resume.folder.name))
    moved = replace(job, config=replace(job.config, runs_dir=str(folder.parent)),
                    weights_root=weights_root or job.weights_root)
    return replace(spec, kwargs={**spec.kwargs, "job": moved})


SHARED_STORES = (
    ("actor_forward", "actor_train", "actor_forward reads each policy from actor_train's weight store in /dev/shm"),
    ("medusa_train", "actor_train", "medusa_train reads each policy from actor_train's weight store in /dev/shm"),
    ("rollout", "medusa_train", "rollout reads the Medusa heads from medusa_train's weight store in /dev/shm"),
)


def _same_host(cfg: RLJobConfig, stages: dict[str, StageSpec]) -> list[tuple[str, str, str]]:
    """The stage pairs that meet through one host's /dev/shm weight store."""
    pairs = [pair for pair in SHARED_STORES if pair[0] in stages and pair[1] in stages]
    if TRANSPORTS[cfg.weights.transport].one_host:
        pairs.append(("rollout", "actor_train", f"weights.transport={cfg.weights.transport} is one host's "
                                                "(broadcast crosses hosts)"))
    return pairs


def _weights_across_hosts(cfg: RLJobConfig) -> tuple[RLJobConfig, str]:
    """`cfg` with weights.transport broadcast when rollout and actor_train may run on different
    hosts of `ray.node_hosts`, and the plan's line saying so ('' when nothing changed)."""
    pins = cfg.ray.stage_resources
    same_nodes = pins.get("rollout") and pins.get("rollout") == pins.get("actor_train")
    transport = cfg.weights.transport
    if cfg.launcher != "ray" or not cfg.ray.node_hosts or same_nodes or not TRANSPORTS[transport].one_host:
        return cfg, ""
    why = "rollout and actor_train may run on different hosts (ray.node_hosts, not pinned to the same nodes)"
    if TRANSPORTS[transport].needs_cuda:  # one GPU's: asked for on purpose, not replaced behind the user's back
        raise ConfigError(f"weights.transport={transport}: {why}; use broadcast")
    return replace(cfg, weights=replace(cfg.weights, transport="broadcast")), \
        f"across hosts: weights.transport {transport} -> broadcast ({why}; /dev/shm is one host's)"


def preview_plan(cfg: RLJobConfig) -> JobPlan:
    """The plan the driver would compile for `cfg`, from where it puts the dataset and the warm
    start, without making them."""
    from stream_rlhf.driver.warm_start import warm_start_folder
    from stream_rlhf.models.checkpoint import is_vision_language
    from stream_rlhf.rl.task_data import data_files

    cfg, unwritten = data_files(cfg)
    folder, ready = warm_start_folder(cfg)
    if cfg.model.path is not None and not ready:
        raise ConfigError(f"model.path={cfg.model.path!r}: not a folder")
    vision = is_vision_language(folder) if ready else cfg.model.tiny.vision is not None
    if unwritten is not None and cfg.model.path is None:  # its cache key hashes the written files too
        folder = folder.parent / "tiny-<its key, once the prompt files are written>"
    weights = str(weights_root(cfg.broker.shm_prefix, cfg.name))
    cfg, choice = auto_placed(cfg, str(folder), weights, vision)
    return compile_plan(cfg, str(folder), weights, vision, checkpoint_ready=ready, dataset_ready=unwritten is None,
                        dataset=unwritten, placement_auto=choice.as_dict() if choice else None)
