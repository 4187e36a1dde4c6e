"""Critic forward: the value of the state before each response token, from the newest critic, and
never from a critic that has trained on fewer iterations than the actor that generated the
mini-batch (`iterations_trained_at`: the batch's policy version, plus a critic warm-up's
iterations once past it). Under the sync schedule that is exactly the critic of the iteration
before, not whichever of it and its predecessor the timing of critic_train's publish gives.

Inside a warm-up the policy version stays 0 and says nothing of the iteration, and rollout runs
ahead; there a batch of iteration i waits for the critic of iteration i - overlap_depth when this
forward has valued every mini-batch of the iterations before that (so the sync schedule stays
reproducible). It never waits otherwise: that critic could need a batch queued behind this one.
With several ranks each computes a share of the mini-batch. On another host than critic_train each
version comes by a broadcast group (`critic_weights.py`)."""

from __future__ import annotations

from stream_rlhf.backends.engines import build_train_engine
from stream_rlhf.rl.reward_parts_config import iterations_trained_at
from stream_rlhf.samples import Rollout, ragged, response_slices
from stream_rlhf.stage import Batch, DeviceState, Output, Stage, StageContext, StepAborted
from stream_rlhf.stages.critic_weights import CriticRelay
from stream_rlhf.stages.images import ImageInputs
from stream_rlhf.stages.job_context import JobContext, stage_counts
from stream_rlhf.stages.topics import topic_output
from stream_rlhf.weights.shm_store import WeightStore

CRITIC_POLL_S = 0.005


class CriticForward(Stage):
    def __init__(self, job: JobContext):
        self.job = job
        self.version = 0
        self.relay: CriticRelay | None = None
        self.valued_before = job.start_iteration
        """Every mini-batch of the iterations before this one has been valued here."""
        self.valued: dict[int, set[int]] = {}
        """The mini-batches valued of the later iterations."""

    def setup(self, ctx: StageContext) -> None:
        super().setup(ctx)
        self.engine = build_train_engine(self.job.config, "critic_forward", self.job.checkpoint, ctx.group)
        self.images = ImageInputs(self.job, stage_counts(self.job, ctx), ctx.group.device)
        self.weights = WeightStore(self.job.weights_root, "critic")
        self.relay = CriticRelay.join(self.job, ctx.group)  # on several hosts: versions by broadcast

    def device_state(self) -> list[DeviceState]:
        return [self.engine]

    def await_inputs(self, batch: Batch) -> None:
        """Until the critic store holds the version the batch needs (`_needed`) or newer."""
        needed = self._needed(batch)
        if self.relay is not None and self.version < needed:
            self.relay.fetch(needed, self.weights, self.ctx)
        while self.version < needed and self.weights.latest_version() < needed:
            if self.ctx.stopping.wait(CRITIC_POLL_S):
                raise StepAborted(f"stopping while waiting for critic version {needed}")

    def _needed(self, batch: Batch) -> int:
        """The oldest critic that may value `batch` (see the module docstring): critic_train
        publishes version v after its v-th iteration, which needs this forward's values of every
        mini-batch before iteration v and nothing later."""
        cfg = self.job.config
        needed = iterations_trained_at(batch.policy_version, cfg.critic.warmup_iterations)
        before = batch.iteration - cfg.overlap_depth
        return before if needed < before <= self.valued_before else needed

    def _count_valued(self, batch: Batch) -> None:
        self.valued.setdefault(batch.iteration, set()).add(batch.minibatch)
        while len(self.valued.get(self.valued_before, ())) == self.job.config.rollout_batch.minibatches:
            del self.valued[self.valued_before]
            self.valued_before += 1

    def close(self) -> None:
        if self.relay is not None:
            self.relay.close()

    def step(self, batch: Batch | None) -> list[Output]:
        self.version = self.engine.refresh(self.weights, self.version)
        rollout = Rollout.from_tensors(batch.tensors)
        values = self.engine.forward_values(rollout.sequences, self.images.of(batch.tensors), rollout.prompt_lens)
        self._count_valued(batch)
        return [topic_output("values", ragged("values", response_slices(values, rollout.prompt_lens)),
                             batch.num_samples)]

