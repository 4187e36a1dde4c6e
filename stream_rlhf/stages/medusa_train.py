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
from pathlib import Path

import torch

from stream_rlhf.stage import Batch, Output, Stage, StageContext
from stream_rlhf.models.checkpoint import load_policy
from stream_rlhf.models.medusa import heads_loss, load_rollout_heads, save_heads
from stream_rlhf.models.packing import packed_hidden_states
from stream_rlhf.experience import Experience, IterationBuffer
from stream_rlhf.seeding import seeded_generator
from stream_rlhf.stages.job_context import JobContext
from stream_rlhf.stages.trainer_checkpoint import ENGINE, STATE, checkpoint_store
from stream_rlhf.stages.training import MetricMeans, minibatch_indices
from stream_rlhf.telemetry.metrics import MetricsWriter
from stream_rlhf.weights.shm_store import WeightStore

PART = "medusa"
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
        self.device = ctx.group.device
        self.backbone = load_policy(self.job.checkpoint).eval().requires_grad_(False).to(self.device)
        self.heads = load_rollout_heads(self.job.checkpoint, self.backbone, cfg.heads).train().to(self.device)
        self.optimizer = torch.optim.AdamW(self.heads.parameters(), lr=cfg.lr, weight_decay=0.0)
        self.actor = WeightStore(self.job.weights_root, "actor")
        self.store = WeightStore(self.job.weights_root, "medusa")
        self.metrics = MetricsWriter(self.job.run_dir, "medusa", "medusa_metrics.jsonl")
        self.checkpoints = checkpoint_store(self.job.run_dir, self.job.config)
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
        self.backbone_version = self.actor.refresh(self.backbone, self.backbone_version)
        exp = Experience.from_batches(batches)
        cfg = self.job.config
        generator = seeded_generator(cfg.seed, "medusa_train", iteration)
        means = MetricMeans()
        for _ in range(cfg.rollout.medusa.epochs):
            for index in minibatch_indices(exp.num_samples, cfg.algorithm.train_minibatches, generator):
                part = exp.select(index)
                with torch.no_grad():
                    hidden = packed_hidden_states(self.backbone, part.sequences)
                loss, metrics = heads_loss(self.heads, hidden, part.sequences, part.prompt_lens.tolist())
                self.optimizer.zero_grad()
                loss.backward()
                self.optimizer.step()
                means.add({"loss": loss.item(), **metrics})
        self.published += 1
        self.store.publish(self.heads, self.published, {"backbone_version": str(self.backbone_version)})
        self.metrics.write({"iteration": iteration, "backbone_version": self.backbone_version,
                            "skipped_iterations": self.skipped_iterations,
                            "train_s": round(time.monotonic() - started, 3), **means.means()})
        if cfg.checkpoint.due(iteration + 1, cfg.iterations):
            self.checkpoints.write_part(iteration + 1, PART, self._save)

    def _save(self, folder: Path) -> None:
        torch.save({"heads": self.heads.state_dict(), "optimizer": self.optimizer.state_dict()}, folder / ENGINE)
        (folder / STATE).write_text(json.dumps({"published": self.published, "backbone_version": self.backbone_version,
                                                "skipped_iterations": self.skipped_iterations}))

    def _resume(self, ctx: StageContext) -> None:
        """The newest medusa part at or before the resumed checkpoint, published for rollout."""
        found = [v for v in self.checkpoints.versions([PART]) if v <= self.job.start_version]
        if not found:
            ctx.log.info("no Medusa heads in the checkpoints up to version %d: starting from the warm start's",
                         self.job.start_version)
            return
        folder = self.checkpoints.folder(found[-1]) / PART
        saved = torch.load(folder / ENGINE, map_location=self.device, weights_only=True)
        self.heads.load_state_dict(saved["heads"])
        self.optimizer.load_state_dict(saved["optimizer"])
        state = json.loads((folder / STATE).read_text())
        self.published, self.skipped_iterations = state["published"], state["skipped_iterations"]
        self.store.publish(self.heads, self.published, {"backbone_version": str(state["backbone_version"])})
        ctx.log.info("resumed the Medusa heads of %s (backbone version %d)", folder, state["backbone_version"])

    def close(self) -> None:
        """The heads go into the run's checkpoint folder (actor_train wrote it before the stop)."""
        if hasattr(self, "heads"):
            save_heads(self.heads, self.job.run_dir / "checkpoint")
