"""An RL job's plan (`launch/plan.py`), compiled once, in the driver.

    plan = compile_plan(cfg, checkpoint, weights_root, vision_language)  # after the driver's warm start
    plan = preview_plan(cfg)      # `stream-rlhf plan` and `stage`: nothing written, trained or started

`preview_plan` finds the dataset and the warm-start checkpoint where the driver puts them without
making either: `stream-rlhf plan` says whether they are there yet, `stream-rlhf stage` refuses to
start a rank before the driver made them (each stage process used to warm-start on its own).
"""

from __future__ import annotations

import torch

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
    return JobPlan(cfg.name, flow, cfg.launcher, cfg.ray, checkpoint, checkpoint_ready, dataset, dataset_ready,
                   checks)


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
