"""What a trainer (actor_train, critic_train) saves at a run checkpoint and reads back on resume.

    checkpoints = TrainerCheckpoints(job, "actor", engine, ctx.group)
    state = checkpoints.resume()              # None for a fresh run; else what `save` was given
    checkpoints.iteration_started()           # the engine's state is in between versions now
    checkpoints.iteration_done(version, state)  # saved when due (`checkpoint.every`); after the first,
                                                # the snapshot's host memory is reserved
    checkpoints.save_at_stop(version, state)  # at a drain, unless an iteration was cut short

A trainer's part of a checkpoint (`resume/store.py`) is its engine's state (`engine.pt`: full
weights, optimizer state, RNG) and `state.json` (the policy version, the KL coefficient, its
counters). Every rank of a group takes part in a save's snapshot (the engine gathers its shards
into host memory); then training goes on while the leader writes it in a background thread
(`resume/background_writer.py`; `checkpoint.background: false` writes it before going on), and
deletes checkpoints older than `checkpoint.keep` complete ones and rollout's kept outputs
(`generated_store.py`) of the iterations those covered. A save waits for the write before it; a
stop waits for the last.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from stream_rlhf.backends.train_engine import TrainEngine
from stream_rlhf.distributed import RankGroup
from stream_rlhf.resume.background_writer import BackgroundWriter, write_delay
from stream_rlhf.resume.store import FOLDER, CheckpointStore
from stream_rlhf.rl.config import RLJobConfig
from stream_rlhf.stages.generated_store import prune_checkpoints
from stream_rlhf.stages.job_context import JobContext
from stream_rlhf.telemetry import trace

ENGINE = "engine.pt"
STATE = "state.json"
STAGE_PARTS = {"actor_train": "actor", "critic_train": "critic", "medusa_train": "medusa"}
"""The part of a run checkpoint each training stage writes."""


def checkpoint_parts(cfg: RLJobConfig) -> list[str]:
    """The parts a complete checkpoint of this run has: one per trainer (Medusa's is optional)."""
    return [STAGE_PARTS["actor_train"], *([STAGE_PARTS["critic_train"]] if cfg.algorithm.uses_critic else [])]


def checkpoint_store(run_dir: Path, cfg: RLJobConfig) -> CheckpointStore:
    return CheckpointStore(run_dir / FOLDER, cfg.checkpoint.keep)


def save_part(writer: BackgroundWriter, store: CheckpointStore, part: str, version: int,
              snapshot: Callable[[], dict | None], state: dict[str, Any],
              after: Callable[[], None] | None = None) -> None:
    """`part` of checkpoint `version`: once the write before it is done (its snapshot freed),
    `snapshot()` now (every rank of a group takes part), then `writer` writes what it gave (the
    leader; the others get None) as ENGINE beside `state` as STATE, and calls `after`."""
    writer.wait()
    with trace.span("checkpoint snapshot", "checkpoint", version=version, part=part):
        taken = snapshot()
    if taken is None:
        return
    record = json.dumps({**state, "version": version}, indent=1)

    def fill(folder: Path) -> None:
        torch.save(taken, folder / ENGINE)
        (folder / STATE).write_text(record)
        write_delay()

    def write() -> None:
        store.write_part(version, part, fill)
        if after is not None:
            after()

    writer.submit(version, write)


class TrainerCheckpoints:
    def __init__(self, job: JobContext, part: str, engine: TrainEngine, group: RankGroup):
        self.job, self.part, self.engine, self.group = job, part, engine, group
        self.store = checkpoint_store(job.run_dir, job.config)
        self.saved = -1
        """The newest version this process saved (or resumed from; its write may still be under way)."""
        self.in_iteration = False
        """An iteration's optimizer steps began and its version is not complete yet."""
        self.reserved = False
        """The engine was asked to reserve its snapshot's host memory (once, after the first iteration)."""
        self.writer = BackgroundWriter(job.config.checkpoint.background, f"{part} checkpoint writer")

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
        elif not self.reserved:  # the first snapshot's host buffers, allocated while training goes on
            self.engine.reserve_snapshot()
        self.reserved = True

    def save(self, version: int, state: dict[str, Any]) -> None:
        """This trainer's part of checkpoint `version` (a collective over the group's ranks): a
        snapshot of the engine's state now, written by the leader in the background
        (`checkpoint.background`) while training goes on."""
        parts = checkpoint_parts(self.job.config)
        save_part(self.writer, self.store, self.part, version, self.engine.snapshot_state, state,
                  after=lambda: prune_checkpoints(self.store, parts, self.job.run_dir))
        self.saved = version

    def save_at_stop(self, version: int, state: dict[str, Any]) -> None:
        """At a stop (drain): the state not saved yet, unless a failure cut an iteration short
        (its weights are between two versions), and for a group of ranks only when they stopped
        together (a save is a collective; after a failure the other ranks may be gone). Returns
        once every write is on disk."""
        if version > self.saved and version > 0 and not self.in_iteration and self.group.stopped_together:
            self.save(version, state)
        self.writer.wait()
