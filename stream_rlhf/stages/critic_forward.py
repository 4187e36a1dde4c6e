"""Critic forward: the value of the state before each response token, from the newest critic."""

from __future__ import annotations

import torch

from stream_rlhf.broker.stage import Batch, Output, Stage, StageContext
from stream_rlhf.models.checkpoint import load_critic
from stream_rlhf.models.packing import packed_forward
from stream_rlhf.models.vision_language import SampleImages
from stream_rlhf.stages.images import ImageInputs
from stream_rlhf.stages.job_context import JobContext
from stream_rlhf.stages.samples import Rollout, ragged, response_slices
from stream_rlhf.telemetry.stage_counts import StageCounts
from stream_rlhf.weights.shm_store import WeightStore


def response_values(critic: torch.nn.Module, rollout: Rollout,
                    images: list[SampleImages] | None = None) -> list[torch.Tensor]:
    """(R_i,) values: position t's output values the state that predicts token t + 1."""
    per_position = [v[:-1, 0] for v in packed_forward(critic, rollout.sequences, images=images)]  # (L_i - 1,)
    return response_slices(per_position, rollout.prompt_lens)


class CriticForward(Stage):
    def __init__(self, job: JobContext):
        self.job = job
        self.version = 0

    def setup(self, ctx: StageContext) -> None:
        super().setup(ctx)
        self.model = load_critic(self.job.checkpoint).eval()
        self.images = ImageInputs(self.job, StageCounts(self.job.run_dir, ctx.stage, ctx.instance_id))
        self.weights = WeightStore(self.job.weights_root, "critic")

    def step(self, batch: Batch | None) -> list[Output]:
        self.version = self.weights.refresh(self.model, self.version)
        with torch.inference_mode():
            values = response_values(self.model, Rollout.from_tensors(batch.tensors), self.images.of(batch.tensors))
        return [Output("values", ragged("values", values), batch.num_samples)]
