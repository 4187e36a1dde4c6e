"""An RL job's plan (`launch/plan.py`), compiled once, in the driver.

    plan = compile_plan(cfg, checkpoint, weights_root, vision_language)  # after the driver's warm start
    plan = preview_plan(cfg)      # `stream-rlhf plan` and `stage`: nothing written, trained or started

`preview_plan` finds the dataset and the warm-start checkpoint where the driver puts them without
making either: `stream-rlhf plan` says whether they are there yet, `stream-rlhf stage` refuses to
start a rank before the driver made them (each stage process used to warm-start on its own).

A plan that spans hosts (`JobPlan.spans_hosts`) carries CURVE keys: those of `broker.curve.key_dir`
when the config names a folder, else a pair the driver makes. Under `ray.node_hosts`, when rollout
and actor_train are not pinned to the same nodes (`ray.stage_resources`), the weights travel by the
broadcast group instead of the shared-memory store, which is one host's.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from stream_rlhf.broker.sockets import CurveKeys
from stream_rlhf.config import ConfigError
from stream_rlhf.launch.placement import machine_cores
from stream_rlhf.launch.plan import JobPlan
from stream_rlhf.resume.store import ResumePoint
from stream_rlhf.rl.config import RLJobConfig
from stream_rlhf.rl.dataflow import compile_job
from stream_rlhf.weights.shm_store import weights_root


def compile_plan(cfg: RLJobConfig, checkpoint: str, weights: str, vision_language: bool,
                 resume: ResumePoint | None = None, checkpoint_ready: bool = True,
                 dataset_ready: bool = True, dataset: dict[str, str] | None = None) -> JobPlan:
    """The plan of `cfg` (its data already resolved, or `dataset`: the files still to write)
    starting from `checkpoint`."""
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
        checks.append(f"ray: every bundle must fit a node of the cluster within ray.start_timeout_s="
                      f"{cfg.ray.start_timeout_s:g} (checked when the placement group is made); ranks are not "
                      "pinned to cores under Ray, their cpus are the bundle's")
    plan = JobPlan(cfg.name, flow, cfg.launcher, cfg.ray, checkpoint, checkpoint_ready, dataset, dataset_ready,
                   checks)
    if not plan.spans_hosts:
        return plan
    curve = cfg.broker.curve
    keys = ("across hosts: the broker and payload servers use CURVE keys "
            + (f"from broker.curve.key_dir={curve.key_dir}" if curve else "the driver made for this run")
            + ", handed to every rank")
    return replace(plan, keys=CurveKeys.read(curve.key_dir) if curve else CurveKeys.generate(),
                   checks=[*checks, keys, *([weights_check] if weights_check else [])])


def _weights_across_hosts(cfg: RLJobConfig) -> tuple[RLJobConfig, str]:
    """`cfg` with weights.transport broadcast when rollout and actor_train may run on different
    hosts of `ray.node_hosts`, and the plan's line saying so ('' when nothing changed)."""
    pins = cfg.ray.stage_resources
    same_nodes = pins.get("rollout") and pins.get("rollout") == pins.get("actor_train")
    if cfg.launcher != "ray" or not cfg.ray.node_hosts or same_nodes or cfg.weights.transport == "broadcast":
        return cfg, ""
    why = "rollout and actor_train may run on different hosts (ray.node_hosts, not pinned to the same nodes)"
    if cfg.weights.transport == "cuda_ipc":
        raise ConfigError(f"weights.transport=cuda_ipc: {why}; use broadcast")
    if cfg.restarts.get("rollout", 0):
        raise ConfigError(f"restarts.rollout={cfg.restarts['rollout']}: {why}, so the weights go by the broadcast "
                          "group, which a restarted rollout cannot rejoin")
    return replace(cfg, weights=replace(cfg.weights, transport="broadcast")), \
        f"across hosts: weights.transport shm -> broadcast ({why}; /dev/shm is one host's)"


def preview_plan(cfg: RLJobConfig) -> JobPlan:
    """The plan the driver would compile for `cfg`, from where it puts the dataset and the warm
    start, without making them."""
    from stream_rlhf.models.checkpoint import is_vision_language
    from stream_rlhf.models.warm_start import warm_start_folder
    from stream_rlhf.rl.task_data import data_files

    cfg, unwritten = data_files(cfg)
    folder, ready = warm_start_folder(cfg)
    if cfg.model.path is not None and not ready:
        raise ConfigError(f"model.path={cfg.model.path!r}: not a folder")
    vision = is_vision_language(folder) if ready else cfg.model.tiny.vision is not None
    if unwritten is not None and cfg.model.path is None:  # its cache key hashes the written files too
        folder = folder.parent / "tiny-<its key, once the prompt files are written>"
    return compile_plan(cfg, str(folder), str(weights_root(cfg.broker.shm_prefix, cfg.name)), vision,
                        checkpoint_ready=ready, dataset_ready=unwritten is None, dataset=unwritten)
