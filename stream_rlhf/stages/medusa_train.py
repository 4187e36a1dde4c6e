"""Companion training of the Medusa heads, beside actor and critic training.

    experience (iteration i) ─► backbone hidden states (newest actor weights, frozen) ─► heads
    loss on the response tokens ─► publish heads v(n+1), tagged with the backbone version

It takes the same experiences as the trainers but never holds them up: when it falls behind,
it trains on the newest complete iteration and skips the older ones (counted). Rollout uses the
heads only while their backbone trails its own by at most `rollout.medusa.max_lag` versions, so
the heads' lag is bounded whatever this stage's speed. The hidden states are recomputed with the
newest actor weights the trainer published, not sent over the broker. At the stop the heads are
saved into the run's checkpoint folder beside the policy. For `--resume` it saves its own part of
a run checkpoint (heads, optimizer, counters: `medusa/`) whenever it has trained an iteration
whose version is due; being a companion, it is not needed for a checkpoint to be complete: a
resumed run takes the newest medusa part at or before its checkpoint, or starts from the warm
start's heads if there is none (the heads' lag is bounded at rollout either way).
"""

from __future__ import annotations

import json
import time

from stream_rlhf.algos.medusa import heads_loss
from stream_rlhf.backends.medusa_engine import MedusaTrainEngine
from stream_rlhf.experience import Experience, IterationBuffer
from stream_rlhf.resume.background_writer import BackgroundWriter
from stream_rlhf.seeding import seeded_generator
from stream_rlhf.stage import Batch, Output, Stage, StageContext
from stream_rlhf.stages.job_context import JobContext
from stream_rlhf.stages.trainer_checkpoint import ENGINE, STAGE_PARTS, STATE, checkpoint_store, save_part
from stream_rlhf.stages.training import MetricMeans, minibatch_indices
from stream_rlhf.telemetry.metrics import MetricsWriter
from stream_rlhf.weights.shm_store import WeightStore

PART = STAGE_PARTS["medusa_train"]
"""This stage's part of a run checkpoint (`resume/store.py`)."""


class MedusaTrain(Stage):
    def __init__(self, job: JobContext):
        self.job = job
        self.buffer = IterationBuffer(job.config.rollout_batch.minibatches)
        self.backbone_version = 0
        self.published = 0
        self.skipped_iterations = 0

    def setup(self, ctx: StageContext) -> None:
        super().setup(ctx)
        cfg = self.job.config.rollout.medusa
        self.engine = MedusaTrainEngine(self.job.checkpoint, cfg.heads, cfg.lr, ctx.group.device)
        self.actor = WeightStore(self.job.weights_root, "actor")
        self.store = WeightStore(self.job.weights_root, "medusa")
        self.metrics = MetricsWriter(self.job.run_dir, "medusa", "medusa_metrics.jsonl")
        self.checkpoints = checkpoint_store(self.job.run_dir, self.job.config)
        self.writer = BackgroundWriter(self.job.config.checkpoint.background, "medusa checkpoint writer")
        if self.job.resume is not None:
            self._resume(ctx)

    def step(self, batch: Batch | None) -> list[Output]:
        self.buffer.add(batch)
        if (taken := self.buffer.take_newest()) is not None:
            batches, skipped = taken
            self.skipped_iterations += skipped
            self._train(batches[0].iteration, batches)
        return []

    def _train(self, iteration: int, batches: list[Batch]) -> None:
        started = time.monotonic()
        self.backbone_version = self.engine.refresh(self.actor, self.backbone_version)
        exp = Experience.from_batches(batches)
        cfg = self.job.config
        generator = seeded_generator(cfg.seed, "medusa_train", iteration)
        means = MetricMeans()
        for _ in range(cfg.rollout.medusa.epochs):
            for index in minibatch_indices(exp.num_samples, cfg.algorithm.train_minibatches, generator):
                means.add(self.engine.train_step(exp.select(index), heads_loss))
        self.published += 1
        self.engine.publish(self.store, self.published, {"backbone_version": str(self.backbone_version)})
        self.metrics.write({"iteration": iteration, "backbone_version": self.backbone_version,
                            "skipped_iterations": self.skipped_iterations,
                            "train_s": round(time.monotonic() - started, 3), **means.means()})
        if cfg.checkpoint.due(iteration + 1, cfg.iterations):
            state = {"published": self.published, "backbone_version": self.backbone_version,
                     "skipped_iterations": self.skipped_iterations}
            save_part(self.writer, self.checkpoints, PART, iteration + 1, self.engine.snapshot_state, state)

    def _resume(self, ctx: StageContext) -> None:
        """The newest medusa part at or before the resumed checkpoint, published for rollout."""
        found = [v for v in self.checkpoints.versions([PART]) if v <= self.job.start_iteration]
        if not found:
            ctx.log.info("no Medusa heads in the checkpoints up to iteration %d: starting from the warm start's",
                         self.job.start_iteration)
            return
        folder = self.checkpoints.folder(found[-1]) / PART
        self.engine.load_state(folder / ENGINE)
        state = json.loads((folder / STATE).read_text())
        self.published, self.skipped_iterations = state["published"], state["skipped_iterations"]
        self.engine.publish(self.store, self.published, {"backbone_version": str(state["backbone_version"])})
        ctx.log.info("resumed the Medusa heads of %s (backbone version %d)", folder, state["backbone_version"])

    def close(self) -> None:
        """The pending checkpoint write lands; the heads go into the run's checkpoint folder
        (actor_train wrote it before the stop)."""
        if hasattr(self, "writer"):
            self.writer.wait()
        if hasattr(self, "engine"):
            self.engine.save(self.job.run_dir / "checkpoint")
