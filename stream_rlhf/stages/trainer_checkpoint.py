"""What a trainer (actor_train, critic_train) saves at a run checkpoint and reads back on resume.

    checkpoints = TrainerCheckpoints(job, "actor", engine, ctx.group)
    state = checkpoints.resume()              # None for a fresh run; else what `save` was given
    checkpoints.iteration_started()           # the engine's state is in between versions now
    checkpoints.iteration_done(version, state)  # saved when due (`checkpoint.every`)
    checkpoints.save_at_stop(version, state)  # at a drain, unless an iteration was cut short

A trainer's part of a checkpoint (`resume/store.py`) is its engine's state (`engine.pt`: full
weights, optimizer state, RNG) and `state.json` (the policy version, the KL coefficient, its
counters). Every rank of a group takes part in a save (the engine gathers its shards); the
leader writes, then deletes checkpoints older than `checkpoint.keep` complete ones and rollout's
kept outputs (`generated_store.py`) of the iterations those covered.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from stream_rlhf.backends.train_engine import TrainEngine
from stream_rlhf.distributed import RankGroup
from stream_rlhf.resume.store import FOLDER, CheckpointStore
from stream_rlhf.rl.config import RLJobConfig
from stream_rlhf.stages.generated_store import prune_checkpoints
from stream_rlhf.stages.job_context import JobContext
from stream_rlhf.telemetry import trace

ENGINE = "engine.pt"
STATE = "state.json"


def checkpoint_parts(cfg: RLJobConfig) -> list[str]:
    """The parts a complete checkpoint of this run has: one per trainer."""
    return ["actor", "critic"] if cfg.algorithm.uses_critic else ["actor"]


def checkpoint_store(run_dir: Path, cfg: RLJobConfig) -> CheckpointStore:
    return CheckpointStore(run_dir / FOLDER, cfg.checkpoint.keep)


class TrainerCheckpoints:
    def __init__(self, job: JobContext, part: str, engine: TrainEngine, group: RankGroup):
        self.job, self.part, self.engine, self.group = job, part, engine, group
        self.store = checkpoint_store(job.run_dir, job.config)
        self.saved = -1
        """The newest version this process saved (or resumed from)."""
        self.in_iteration = False
        """An iteration's optimizer steps began and its version is not complete yet."""

    def resume(self) -> dict[str, Any] | None:
        """Load this trainer's part of the checkpoint the run resumes from into the engine; its
        state, or None for a fresh run."""
        if self.job.resume is None:
            return None
        folder = self.job.resume.part(self.part)
        self.engine.load_state(folder / ENGINE)
        state = json.loads((folder / STATE).read_text())
        self.saved = state["version"]
        return state

    def iteration_started(self) -> None:
        self.in_iteration = True

    def iteration_done(self, version: int, state: dict[str, Any]) -> None:
        """`version` is complete: save it if `checkpoint.every` says so."""
        self.in_iteration = False
        if self.job.config.checkpoint.due(version, self.job.config.iterations):
            self.save(version, state)

    def save(self, version: int, state: dict[str, Any]) -> None:
        """This trainer's part of checkpoint `version` (a collective over the group's ranks)."""
        if not self.group.is_leader:
            self.engine.save_state(Path(os.devnull))  # gathers the shards; only the leader writes
            self.saved = version
            return

        def write(folder: Path) -> None:
            self.engine.save_state(folder / ENGINE)
            (folder / STATE).write_text(json.dumps({**state, "version": version}, indent=1))

        with trace.span("checkpoint save", "checkpoint", version=version, part=self.part):
            self.store.write_part(version, self.part, write)
        prune_checkpoints(self.store, checkpoint_parts(self.job.config), self.job.run_dir)
        self.saved = version

    def save_at_stop(self, version: int, state: dict[str, Any]) -> None:
        """At a stop (drain): the state not saved yet, unless a failure cut an iteration short
        (its weights are between two versions), and for a group of ranks only when they stopped
        together (a save is a collective; after a failure the other ranks may be gone)."""
        if version > self.saved and version > 0 and not self.in_iteration and self.group.stopped_together:
            self.save(version, state)
