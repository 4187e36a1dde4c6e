"""Reference forward: log-probs of the response tokens under the frozen starting policy (for KL).
With several ranks each computes a share of the mini-batch."""

from __future__ import annotations

from stream_rlhf.backends.engines import build_train_engine
from stream_rlhf.samples import Rollout, ragged, response_slices
from stream_rlhf.stage import Batch, DeviceState, Output, Stage, StageContext
from stream_rlhf.stages.images import ImageInputs
from stream_rlhf.stages.job_context import JobContext, stage_counts
from stream_rlhf.stages.topics import topic_output


class RefForward(Stage):
    def __init__(self, job: JobContext):
        self.job = job

    def setup(self, ctx: StageContext) -> None:
        super().setup(ctx)
        self.engine = build_train_engine(self.job.config, "ref_forward", self.job.checkpoint, ctx.group)
        self.images = ImageInputs(self.job, stage_counts(self.job, ctx), ctx.group.device)

    def device_state(self) -> list[DeviceState]:
        return [self.engine]

    def step(self, batch: Batch | None) -> list[Output]:
        rollout = Rollout.from_tensors(batch.tensors)
        logp = self.engine.forward_logprobs(rollout.sequences, self.job.config.rollout.temperature,
                                            images=self.images.of(batch.tensors), prompt_lens=rollout.prompt_lens)
        return [topic_output("ref_logp", ragged("ref_logp", response_slices(logp, rollout.prompt_lens)),
                             batch.num_samples)]
