"""Critic training: clipped value regression on the returns of each iteration, then a new critic
version for the critic forward.

Returns come from the same token rewards and GAE as the actor's advantages. The KL coefficient
in the reward is recomputed here with the same controller and the same experiences as
actor_train, so both trainers agree on it without talking to each other.
"""

from __future__ import annotations

import torch

from stream_rlhf.algos.losses import value_loss
from stream_rlhf.algos.masked import masked_mean
from stream_rlhf.broker.stage import Batch, Output, Stage, StageContext
from stream_rlhf.models.checkpoint import load_critic
from stream_rlhf.stages.actor_train import advantages_of, kl_controller, minibatch_indices
from stream_rlhf.stages.critic_forward import response_values
from stream_rlhf.stages.experience import Experience, IterationBuffer
from stream_rlhf.stages.job_context import JobContext, seeded_generator
from stream_rlhf.stages.samples import Rollout
from stream_rlhf.telemetry.metrics import MetricsWriter
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

    def step(self, batch: Batch | None) -> list[Output]:
        self.buffer.add(batch)
        while (batches := self.buffer.take(self.version)) is not None:
            fresh = [b for b in batches if self.version - b.policy_version <= self.job.config.overlap_depth]
            if fresh:
                self._update(Experience.from_batches(fresh))
            self.version += 1
            self.weights.publish(self.model, self.version)
        return []

    def _update(self, exp: Experience) -> None:
        cfg = self.job.config
        algo = cfg.algorithm
        kl_mean = masked_mean(exp.kl(algo.kl.kind), exp.mask).item()
        _, returns = advantages_of(exp, self.job, self.kl_ctl.coef)
        generator = seeded_generator(cfg.seed, "critic_train", self.version)
        sums: dict[str, float] = {}
        steps = 0
        for _ in range(algo.ppo_epochs):
            for index in minibatch_indices(exp.num_samples, algo.train_minibatches, generator):
                part = exp.select(index)
                rollout = Rollout(part.sequences, part.prompt_lens, [], part.group_ids)
                values = part.padded(response_values(self.model, rollout))  # (n, R)
                loss, metrics = value_loss(values, part.values, returns[index], part.mask, algo.value_clip)
                self.optimizer.zero_grad()
                loss.backward()
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.critic.max_grad_norm)
                self.optimizer.step()
                metrics["value_loss"] = loss.item()
                for key, value in metrics.items():
                    sums[key] = sums.get(key, 0.0) + value
                steps += 1
        self.kl_ctl.update(kl_mean, exp.num_samples)
        self.metrics.write({"iteration": self.version, **{k: round(v / steps, 5) for k, v in sums.items()}})
