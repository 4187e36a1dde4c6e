"""The driver's side of `stream-rlhf run CONFIG --resume`: which checkpoint, whether the config
still fits it, and the run folder made ready to continue from it.

    record_start(run_dir, cfg, eval_before, start_checkpoint)   # a fresh run, before its stages
    resumed = prepare_resume(run_dir, cfg, weights_root)        # a resumed run, before its stages
    append_switch(run_dir, {...})                               # a placement switch (`placement_switch.py`)

A fresh run writes `checkpoints/run.json`: its config, the eval before RL and the checkpoint it
started from, a list of its resumes and one of its placement switches. A resumed run picks the
newest complete and intact checkpoint (`resume/store.py`), refuses a config that changed what
the checkpoint's state depends on (model, task, training data, batch shape, advantage estimator,
seed; a learning rate or the iteration count may change), cuts `metrics.jsonl` and
`critic_metrics.jsonl` back to the checkpoint's iterations, and puts the checkpoint's actor (and
critic) weights in the shared-memory weight store, so rollout and the forwards start from them:
the critic's as the checkpoint's iteration count, the actor's as its policy version (the same
number, less a critic warm-up's iterations: `policy_version_at`).

What the stopped run generated after its checkpoint is in rollout's kept outputs
(`stages/generated_store.py`): the resumed run trains it without generating it again, at the
policy version that generated it. Only samples not kept there (`checkpoint.keep_generated:
false`, or a crash between generating and keeping a mini-batch) are generated again, and counted
in the summary as `samples_discarded_at_resume`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

import torch

from stream_rlhf.config import ConfigError
from stream_rlhf.launch.spec import StageSpec
from stream_rlhf.models.lora import merge_lora
from stream_rlhf.resume.store import FOLDER, ResumePoint
from stream_rlhf.rl.config import RLJobConfig
from stream_rlhf.rl.reward_parts_config import policy_version_at
from stream_rlhf.stages.generated_store import GENERATED, GeneratedStore
from stream_rlhf.stages.job_context import JobContext
from stream_rlhf.stages.prompt_cursor import FILE as PROMPT_CURSORS
from stream_rlhf.stages.trainer_checkpoint import ENGINE, STAGE_PARTS, STATE, checkpoint_parts, checkpoint_store
from stream_rlhf.telemetry.metrics import cut_metrics
from stream_rlhf.telemetry.sample_log import SAMPLES_FILE
from stream_rlhf.telemetry.stage_counts import read_stage_counts
from stream_rlhf.weights.shm_store import WeightStore

log = logging.getLogger("stream_rlhf")
RUN_RECORD = "run.json"
FIXED_KEYS = ("model", "task", "data.train", "rollout_batch", "algorithm.advantage", "actor.lora", "critic.lora",
              "seed")
"""Config keys a resumed run must share with its checkpoint (and every key below them)."""


def record_start(run_dir: Path, cfg: RLJobConfig, eval_before: dict[str, Any], start_checkpoint: str) -> None:
    folder = run_dir / FOLDER
    folder.mkdir(parents=True, exist_ok=True)
    record = {"config": _plain(cfg), "eval_before": eval_before, "start_checkpoint": start_checkpoint, "resumes": [],
              "switches": []}
    (folder / RUN_RECORD).write_text(json.dumps(record, indent=1))


def read_record(run_dir: Path) -> dict[str, Any]:
    return json.loads((run_dir / FOLDER / RUN_RECORD).read_text())


def read_switches(run_dir: Path) -> list[dict[str, Any]]:
    """The run's placement switches (`driver/placement_switch.py`), oldest first; none in a run
    folder written before switches were recorded."""
    return read_record(run_dir).get("switches", [])


def append_switch(run_dir: Path, switch: dict[str, Any]) -> None:
    record = read_record(run_dir)
    record["switches"] = [*record.get("switches", []), switch]
    (run_dir / FOLDER / RUN_RECORD).write_text(json.dumps(record, indent=1))


@dataclasses.dataclass(frozen=True)
class Resumed:
    point: ResumePoint
    eval_before: dict[str, Any]
    start_checkpoint: str
    """The warm start (or `model.path`) the interrupted run started from."""


def prepare_resume(run_dir: Path, cfg: RLJobConfig, weights_root: Path) -> Resumed:
    if not (run_dir / FOLDER / RUN_RECORD).is_file():
        raise ConfigError(f"--resume: {run_dir / FOLDER / RUN_RECORD} does not exist: {run_dir} holds no run to resume")
    record = read_record(run_dir)
    _check_unchanged(record["config"], _plain(cfg))
    point = checkpoint_store(run_dir, cfg).latest(checkpoint_parts(cfg))
    if point is None:
        raise ConfigError(f"--resume: no complete checkpoint in {run_dir / FOLDER} (every {cfg.checkpoint.every} "
                          "iterations; the run stopped before its first)")
    if point.version >= cfg.iterations:
        raise ConfigError(f"iterations={cfg.iterations}: the checkpoint in {point.folder} has trained "
                          f"{point.version} already; raise iterations to train on")
    actor = json.loads((point.part("actor") / STATE).read_text())
    generated = read_stage_counts(run_dir).get("rollout", {}).get("generated", 0)
    discarded = sum(r["discarded"] for r in record["resumes"])
    kept = GeneratedStore(run_dir).samples_from(point.version) if cfg.checkpoint.keep_generated else 0
    new = max(0, generated - discarded - actor["samples_trained"] - sum(actor["dropped_reasons"].values()) - kept)
    record["resumes"].append({"version": point.version, "discarded": new})
    (run_dir / FOLDER / RUN_RECORD).write_text(json.dumps(record, indent=1))
    for name in ("metrics.jsonl", "critic_metrics.jsonl", "trace_metrics.jsonl"):
        cut_metrics(run_dir / name, point.version)
    policy = policy_version_at(point.version, cfg.critic.warmup_iterations)
    for part in checkpoint_parts(cfg):  # the critic's versions count iterations, the actor's policy versions
        weights = merge_lora(torch.load(point.part(part) / ENGINE, map_location="cpu", weights_only=True)["model"])
        version = policy if part == STAGE_PARTS["actor_train"] else point.version
        WeightStore(weights_root, part).publish(weights, version)
    log.info("resuming from %s: iteration %d of %d, policy version %d (of the samples the stopped run generated "
             "after it, %d kept are trained as they are, %d generated again)", point.folder, point.version,
             cfg.iterations, policy, kept, new)
    return Resumed(point, record["eval_before"], record["start_checkpoint"])


def resume_inputs(stage: str, spec: StageSpec) -> list[str]:
    """What a rank of `stage` on another host than the driver's reads, or appends to, of the
    driver's run folder when the run resumes (paths relative to it: the plan's `host_inputs`, which
    the launcher copies there first): a trainer its part of the checkpoint and the metrics it
    continues, Medusa's trainer the newest heads at or before the checkpoint, rollout its kept
    outputs, the prompt source its cursor. Nothing for a fresh run."""
    job: JobContext = spec.kwargs["job"]
    if job.resume is None:
        return []
    if stage == "medusa_train":
        store = checkpoint_store(job.run_dir, job.config)
        found = [v for v in store.versions([STAGE_PARTS[stage]]) if v <= job.resume.version]
        return [f"{FOLDER}/{store.folder(found[-1]).name}/{STAGE_PARTS[stage]}"] if found else []
    point = f"{FOLDER}/{job.resume.folder.name}"
    reads = {"actor_train": [f"{point}/{STAGE_PARTS['actor_train']}", "metrics.jsonl", SAMPLES_FILE],
             "critic_train": [f"{point}/{STAGE_PARTS['critic_train']}", "critic_metrics.jsonl"],
             "rollout": [f"{FOLDER}/{GENERATED}"], "prompts": [f"{FOLDER}/{PROMPT_CURSORS}"]}
    return reads.get(stage, [])


def _plain(cfg: RLJobConfig) -> dict[str, Any]:
    return json.loads(json.dumps(dataclasses.asdict(cfg), default=str))


def _check_unchanged(saved: dict[str, Any], now: dict[str, Any]) -> None:
    for key in FIXED_KEYS:
        before, after = _flat(_at(saved, key), key), _flat(_at(now, key), key)
        for name in sorted(before.keys() | after.keys()):
            if before.get(name) != after.get(name):
                raise ConfigError(f"{name}={after.get(name)!r}: the run to resume had {before.get(name)!r}; a resumed "
                                  "run keeps its model, task, data, batch shape, advantage estimator, LoRA adapters "
                                  "and seed")
    for stage in STAGE_PARTS:
        before, after = _trainer_layout(saved, stage), _trainer_layout(now, stage)
        for name in before:
            if before[name] != after.get(name):
                raise ConfigError(
                    f"placement.stages.{stage}.{name}={after.get(name)!r}: the run to resume checkpointed {stage} "
                    f"with {before[name]!r}; a trainer resumes on the backend that saved its state, and a megatron "
                    "one on the layout it saved it with (ranks, tp, pp, cp: its optimizer state is per rank)")


def _trainer_layout(cfg: dict[str, Any], stage: str) -> dict[str, Any]:
    """What a trainer's saved state depends on: its backend and, for megatron, its ranks and
    parallel sizes (the torch engine's state loads on any number of ranks)."""
    placed = _at(cfg, f"placement.stages.{stage}") or {}
    backend = placed.get("backend", "torch")
    if backend != "megatron":
        return {"backend": backend}
    sizes = placed.get("megatron") or {}
    return {"backend": backend, "ranks": placed.get("ranks", 1),
            **{f"megatron.{size}": sizes.get(size, 1) for size in ("tp", "pp", "cp")}}


def _at(tree: dict[str, Any], key: str) -> Any:
    for part in key.split("."):
        tree = tree.get(part) if isinstance(tree, dict) else None
    return tree


def _flat(value: Any, prefix: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        return {prefix: value}
    out: dict[str, Any] = {}
    for name, inner in value.items():
        out.update(_flat(inner, f"{prefix}.{name}"))
    return out
