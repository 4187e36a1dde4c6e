"""Critic forward: the value of the state before each response token, from the newest critic, and
never from a critic that has trained on fewer iterations than the actor that generated the
mini-batch (its version >= the batch's policy version): under the sync schedule that is exactly
the critic of the iteration before, not whichever of it and its predecessor the timing of
critic_train's publish gives. With several ranks each computes a share of the mini-batch. On
another host than critic_train each version comes by a broadcast group (`critic_weights.py`)."""

from __future__ import annotations

from stream_rlhf.backends.engines import build_train_engine
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

    def setup(self, ctx: StageContext) -> None:
        super().setup(ctx)
        self.engine = build_train_engine(self.job.config, "critic_forward", self.job.checkpoint, ctx.group)
        self.images = ImageInputs(self.job, stage_counts(self.job, ctx), ctx.group.device)
        self.weights = WeightStore(self.job.weights_root, "critic")
        self.relay = CriticRelay.join(self.job, ctx.group)  # on several hosts: versions by broadcast

    def device_state(self) -> list[DeviceState]:
        return [self.engine]

    def await_inputs(self, batch: Batch) -> None:
        """Until the critic store holds the batch's policy version or newer (critic_train publishes
        version i after its i-th iteration, so this never waits on a later iteration's experience)."""
        if self.relay is not None and self.version < batch.policy_version:
            self.relay.fetch(batch.policy_version, self.weights, self.ctx)
        while self.version < batch.policy_version and self.weights.latest_version() < batch.policy_version:
            if self.ctx.stopping.wait(CRITIC_POLL_S):
                raise StepAborted(f"stopping while waiting for critic version {batch.policy_version}")

    def close(self) -> None:
        if self.relay is not None:
            self.relay.close()

    def step(self, batch: Batch | None) -> list[Output]:
        self.version = self.engine.refresh(self.weights, self.version)
        rollout = Rollout.from_tensors(batch.tensors)
        values = self.engine.forward_values(rollout.sequences, self.images.of(batch.tensors), rollout.prompt_lens)
        return [topic_output("values", ragged("values", response_slices(values, rollout.prompt_lens)),
                             batch.num_samples)]

