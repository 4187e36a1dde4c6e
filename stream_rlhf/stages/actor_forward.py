"""Actor forward: log-probs of the response tokens under the newest actor weights.

They are the sampling-time policy's log-probs for the KL penalty, and the proximal log-probs the
PPO loss clips against whenever these weights are the ones training starts from (always with
overlap_depth 0; actor_train recomputes them when rollout ran ahead). Each output records the
version it used as `proximal_version`.
"""

from __future__ import annotations

import torch

from stream_rlhf.broker.stage import Batch, Output, Stage, StageContext
from stream_rlhf.models.checkpoint import load_policy
from stream_rlhf.models.packing import sequence_logprobs
from stream_rlhf.stages.images import ImageInputs
from stream_rlhf.stages.job_context import JobContext
from stream_rlhf.stages.samples import Rollout, ragged, response_slices
from stream_rlhf.telemetry.stage_counts import StageCounts
from stream_rlhf.weights.shm_store import WeightStore


class ActorForward(Stage):
    def __init__(self, job: JobContext):
        self.job = job
        self.version = 0

    def setup(self, ctx: StageContext) -> None:
        super().setup(ctx)
        self.model = load_policy(self.job.checkpoint).eval()
        self.images = ImageInputs(self.job, StageCounts(self.job.run_dir, ctx.stage, ctx.instance_id))
        self.weights = WeightStore(self.job.weights_root, "actor")

    def step(self, batch: Batch | None) -> list[Output]:
        self.version = self.weights.refresh(self.model, self.version)
        rollout = Rollout.from_tensors(batch.tensors)
        with torch.inference_mode():
            logp, _ = sequence_logprobs(self.model, rollout.sequences, self.job.config.rollout.temperature,
                                        images=self.images.of(batch.tensors))
        return [Output("old_logp", ragged("old_logp", response_slices(logp, rollout.prompt_lens)), batch.num_samples,
                       metadata={"proximal_version": self.version})]
