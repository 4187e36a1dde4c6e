"""Critic training: clipped value regression on the returns of each iteration, then a new critic
version for the critic forward.

Returns come from the same token rewards and GAE as the actor's advantages (`training.py`
says why the two trainers agree without talking to each other). With several ranks the critic is
sharded over them (FSDP2, `backends/torch_engine.py`) and each optimizer step's samples are split.
It starts from the policy or, with `critic.init: reward_model`, from the reward model. During the
critic warm-up (`critic.warmup_iterations`) it trains as always while the actor stays at version 0:
its staleness filter compares samples with the actor's version at each iteration, not its own.
"""

from __future__ import annotations

from torch import Tensor

from stream_rlhf.algos.losses import value_loss
from stream_rlhf.algos.masked import masked_mean
from stream_rlhf.backends.engines import build_train_engine
from stream_rlhf.experience import Experience, IterationBuffer
from stream_rlhf.rl.reward_parts_config import policy_version_at
from stream_rlhf.seeding import seeded_generator
from stream_rlhf.stage import Batch, DeviceState, Output, Stage, StageContext
from stream_rlhf.stages.critic_weights import crosses_hosts, open_critic_sender
from stream_rlhf.stages.images import ImageInputs
from stream_rlhf.stages.job_context import JobContext, stage_counts
from stream_rlhf.stages.trainer_checkpoint import STAGE_PARTS, TrainerCheckpoints
from stream_rlhf.stages.training import (
    MetricMeans,
    advantages_of,
    experience_of,
    kl_controller,
    minibatch_indices,
    split_by_staleness,
)
from stream_rlhf.stages.weight_publish import VersionPublisher, publishes_in_background
from stream_rlhf.telemetry import trace
from stream_rlhf.telemetry.metrics import MetricsWriter
from stream_rlhf.weights.shm_store import WeightStore
from stream_rlhf.weights.transport import WeightSender


class CriticTrain(Stage):
    def __init__(self, job: JobContext):
        self.job = job
        self.buffer = IterationBuffer(job.config.rollout_batch.minibatches)
        self.version = 0
        self.kl_ctl = kl_controller(job.config.algorithm.kl)
        self.sender: WeightSender | None = None

    def setup(self, ctx: StageContext) -> None:
        super().setup(ctx)
        cfg = self.job.config
        self.engine = build_train_engine(self.job.config, "critic_train", self.job.checkpoint, ctx.group, cfg.critic)
        self.weights = WeightStore(self.job.weights_root, "critic")
        self.sender = open_critic_sender(self.job) if ctx.group.is_leader else None
        background = publishes_in_background(cfg.weights, self.engine.device)
        self.publisher = VersionPublisher(self.engine, background, "critic")
        self.checkpoints = TrainerCheckpoints(self.job, STAGE_PARTS["critic_train"], self.engine, ctx.group)
        if (state := self.checkpoints.resume()) is not None:
            self.version, self.kl_ctl.coef = state["version"], state["kl_coef"]
            stored = self.weights.latest_version() >= self.version  # not on another host than the driver's
            if crosses_hosts() or not stored:  # a resumed critic_forward asks for this version (every rank exports)
                weights = self.engine.export_weights()
                if not stored and ctx.group.is_leader:
                    self.weights.publish(weights, self.version)
                self._send(weights, self.version)
        self.metrics = MetricsWriter(self.job.run_dir, "critic", "critic_metrics.jsonl", purge_step=self.version) \
            if ctx.group.is_leader else None
        counts = stage_counts(self.job, ctx)
        trained, total = self.engine.parameter_counts()
        counts.set_details(parameters_trained=trained, parameters=total)  # the summary's critic_parameters
        self.images = ImageInputs(self.job, counts, ctx.group.device)

    def device_state(self) -> list[DeviceState]:
        return [self.engine]

    def uses_device(self, batch: Batch | None) -> bool:
        return batch is not None and self.buffer.completes(batch, self.version)

    def step(self, batch: Batch | None) -> list[Output]:
        self.buffer.add(batch)
        while (batches := self.buffer.take(self.version)) is not None:
            self.checkpoints.iteration_started()
            cfg = self.job.config
            actor_version = policy_version_at(self.version, cfg.critic.warmup_iterations)
            fresh, _ = split_by_staleness(batches, actor_version, cfg.overlap_depth)  # actor_train counts drops
            if fresh:
                self._update(experience_of(fresh, self.images))
            self.version += 1
            self.publisher.publish(self.version, self._put_out, self.ctx.group.is_leader)
            self.checkpoints.iteration_done(self.version, {"kl_coef": self.kl_ctl.coef})
        return []

    def close(self) -> None:
        self.publisher.wait()
        self.checkpoints.save_at_stop(self.version, {"kl_coef": self.kl_ctl.coef})
        if self.sender is not None:
            self.sender.close()

    def _put_out(self, weights: dict[str, Tensor], version: int) -> None:
        """The leader's part of publishing `version` (`weight_publish.py`)."""
        self.weights.publish(weights, version)
        self._send(weights, version)

    def _send(self, weights: dict[str, Tensor], version: int) -> None:
        """To critic_forward on another host (`critic_weights.py`), after the store has the version."""
        if self.sender is not None:
            self.sender.publish(weights.items(), version)

    def _update(self, exp: Experience) -> None:
        cfg = self.job.config
        algo = cfg.algorithm
        with trace.span("returns", "train"):
            kl_mean = masked_mean(exp.kl(algo.kl.kind), exp.mask).item()
            _, returns = advantages_of(exp, self.job, self.kl_ctl.coef)
        generator = seeded_generator(cfg.seed, "critic_train", self.version)
        means = MetricMeans()
        for _ in range(algo.ppo_epochs):
            for index in minibatch_indices(exp.num_samples, algo.train_minibatches, generator):
                with trace.span("optimizer step", "train", samples=len(index)):
                    metrics = self.engine.train_step(exp.select(index), self._loss, {"returns": returns[index]})
                metrics["value_loss"] = metrics.pop("loss")
                means.add(metrics)
        self.kl_ctl.update(kl_mean, exp.num_samples)
        if self.metrics is not None:
            warmup = {"critic_warmup": 1} if self.version < cfg.critic.warmup_iterations else {}
            self.metrics.write({"iteration": self.version, **warmup, **means.means()})

    def _loss(self, part: Experience, per_sample: dict[str, Tensor]) -> tuple[Tensor, dict[str, float]]:
        values = self.engine.response_values(part)  # (n, R)
        return value_loss(values, part.values, per_sample["returns"], part.mask, self.job.config.algorithm.value_clip)
