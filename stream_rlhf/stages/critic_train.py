"""Critic training: clipped value regression on the returns of each iteration, then a new critic
version for the critic forward.

Returns come from the same token rewards and GAE as the actor's advantages (`training.py`
says why the two trainers agree without talking to each other).
"""

from __future__ import annotations

import torch

from stream_rlhf.algos.losses import value_loss
from stream_rlhf.algos.masked import masked_mean
from stream_rlhf.broker.stage import Batch, Output, Stage, StageContext
from stream_rlhf.models.checkpoint import load_critic
from stream_rlhf.stages.critic_forward import response_values
from stream_rlhf.stages.experience import Experience, IterationBuffer
from stream_rlhf.stages.images import ImageInputs
from stream_rlhf.stages.job_context import JobContext, seeded_generator
from stream_rlhf.stages.samples import Rollout
from stream_rlhf.stages.training import (
    MetricMeans,
    advantages_of,
    kl_controller,
    minibatch_indices,
    optimizer_step,
    split_by_staleness,
)
from stream_rlhf.telemetry.metrics import MetricsWriter
from stream_rlhf.telemetry.stage_counts import StageCounts
from stream_rlhf.weights.shm_store import WeightStore


class CriticTrain(Stage):
    def __init__(self, job: JobContext):
        self.job = job
        self.buffer = IterationBuffer(job.config.rollout_batch.minibatches)
        self.version = 0
        self.kl_ctl = kl_controller(job.config.algorithm.kl)

    def setup(self, ctx: StageContext) -> None:
        super().setup(ctx)
        cfg = self.job.config
        self.model = load_critic(self.job.checkpoint).train()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.critic.lr, weight_decay=cfg.critic.weight_decay)
        self.weights = WeightStore(self.job.weights_root, "critic")
        self.metrics = MetricsWriter(self.job.run_dir, "critic_metrics.jsonl")
        self.images = ImageInputs(self.job, StageCounts(self.job.run_dir, ctx.stage, ctx.instance_id))

    def step(self, batch: Batch | None) -> list[Output]:
        self.buffer.add(batch)
        while (batches := self.buffer.take(self.version)) is not None:
            fresh, _ = split_by_staleness(batches, self.version, self.job.config.overlap_depth)  # actor_train counts drops
            if fresh:
                self._update(Experience.from_batches(fresh, [self.images.of(b.tensors) for b in fresh]))
            self.version += 1
            self.weights.publish(self.model, self.version)
        return []

    def _update(self, exp: Experience) -> None:
        cfg = self.job.config
        algo = cfg.algorithm
        kl_mean = masked_mean(exp.kl(algo.kl.kind), exp.mask).item()
        _, returns = advantages_of(exp, self.job, self.kl_ctl.coef)
        generator = seeded_generator(cfg.seed, "critic_train", self.version)
        means = MetricMeans()
        for _ in range(algo.ppo_epochs):
            for index in minibatch_indices(exp.num_samples, algo.train_minibatches, generator):
                part = exp.select(index)
                rollout = Rollout(part.sequences, part.prompt_lens, [], part.group_ids)
                values = part.padded(response_values(self.model, rollout, part.images))  # (n, R)
                loss, metrics = value_loss(values, part.values, returns[index], part.mask, algo.value_clip)
                metrics["grad_norm"] = optimizer_step(self.model, self.optimizer, loss, cfg.critic.max_grad_norm)
                metrics["value_loss"] = loss.item()
                means.add(metrics)
        self.kl_ctl.update(kl_mean, exp.num_samples)
        self.metrics.write({"iteration": self.version, **means.means()})
