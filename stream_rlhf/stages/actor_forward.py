"""Actor forward: log-probs of the response tokens under the newest actor weights.

They are the policy's log-probs for the KL penalty and the proximal log-probs the PPO loss clips
against: the dataflow has this stage only with overlap_depth 0, where they come from the weights
training starts from (driver/dataflow.py; with rollout running ahead actor_train computes them
itself). Each output records the version it used as `proximal_version`, and actor_train checks it.
With several ranks each computes a share of the mini-batch.
"""

from __future__ import annotations

from stream_rlhf.backends.engines import build_train_engine
from stream_rlhf.samples import Rollout, ragged, response_slices
from stream_rlhf.stage import Batch, DeviceState, Output, Stage, StageContext
from stream_rlhf.stages.images import ImageInputs
from stream_rlhf.stages.job_context import JobContext, stage_counts
from stream_rlhf.stages.topics import topic_output
from stream_rlhf.weights.shm_store import WeightStore


class ActorForward(Stage):
    def __init__(self, job: JobContext):
        self.job = job
        self.version = 0

    def setup(self, ctx: StageContext) -> None:
        super().setup(ctx)
        self.engine = build_train_engine(self.job.config, "actor_forward", self.job.checkpoint, ctx.group)
        self.images = ImageInputs(self.job, stage_counts(self.job, ctx), ctx.group.device)
        self.weights = WeightStore(self.job.weights_root, "actor")

    def device_state(self) -> list[DeviceState]:
        return [self.engine]

    def step(self, batch: Batch | None) -> list[Output]:
        self.version = self.engine.refresh(self.weights, self.version)
        rollout = Rollout.from_tensors(batch.tensors)
        logp = self.engine.forward_logprobs(rollout.sequences, self.job.config.rollout.temperature,
                                            images=self.images.of(batch.tensors), prompt_lens=rollout.prompt_lens)
        return [topic_output("old_logp", ragged("old_logp", response_slices(logp, rollout.prompt_lens)),
                             batch.num_samples, metadata={"proximal_version": self.version})]
