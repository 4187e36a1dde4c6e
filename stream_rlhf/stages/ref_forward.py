"""Reference forward: log-probs of the response tokens under the frozen starting policy (for KL)."""

from __future__ import annotations

import torch

from stream_rlhf.broker.stage import Batch, Output, Stage, StageContext
from stream_rlhf.models.checkpoint import load_policy
from stream_rlhf.models.packing import sequence_logprobs
from stream_rlhf.stages.images import ImageInputs
from stream_rlhf.stages.job_context import JobContext
from stream_rlhf.stages.samples import Rollout, ragged, response_slices
from stream_rlhf.telemetry.stage_counts import StageCounts


class RefForward(Stage):
    def __init__(self, job: JobContext):
        self.job = job

    def setup(self, ctx: StageContext) -> None:
        super().setup(ctx)
        self.model = load_policy(self.job.checkpoint).eval()
        self.images = ImageInputs(self.job, StageCounts(self.job.run_dir, ctx.stage, ctx.instance_id))

    def step(self, batch: Batch | None) -> list[Output]:
        rollout = Rollout.from_tensors(batch.tensors)
        with torch.inference_mode():
            logp, _ = sequence_logprobs(self.model, rollout.sequences, self.job.config.rollout.temperature,
                                        images=self.images.of(batch.tensors))
        return [Output("ref_logp", ragged("ref_logp", response_slices(logp, rollout.prompt_lens)), batch.num_samples)]
