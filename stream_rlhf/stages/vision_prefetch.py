"""The vision stage: runs the frozen vision tower once per image, ahead of rollout.

    prompts (pixel patches) ─► vision_prefetch ─► vision (image features + the prompts)

Its output handle is the one every later stage reads the features from: rollout consumes it, and
the broker joins it with rollout's output for the forwards and with the forwards' outputs for the
trainers, so no stage encodes an image again. It runs up to `vision.prefetch_depth` mini-batches
ahead of rollout (the vision topic's capacity) and scales out with `vision.instances`,
independently of the language model. Counts `images_encoded` and `encoder_calls`.
"""

from __future__ import annotations

import torch

from stream_rlhf.backends.forward_engine import VisionTowerEngine
from stream_rlhf.stage import Batch, Output, Stage, StageContext
from stream_rlhf.stages.images import IMAGE_FIELDS
from stream_rlhf.stages.job_context import JobContext, stage_counts
from stream_rlhf.stages.topics import topic_output

PROMPT_FIELDS = ("prompt_ids", "prompt_ids_lens", "group_ids")
"""The prompt source's text fields, passed on for rollout."""


class VisionPrefetch(Stage):
    def __init__(self, job: JobContext):
        self.job = job

    def setup(self, ctx: StageContext) -> None:
        super().setup(ctx)
        self.tower = VisionTowerEngine(self.job.checkpoint, ctx.group.device)
        self.counts = stage_counts(self.job, ctx)

    def step(self, batch: Batch | None) -> list[Output]:
        t = batch.tensors
        grid = t["image_grid_thw"].long()
        per_image = [f.cpu() for f in self.tower.image_features(t["pixel_values"], grid)]  # the payload is host memory
        self.counts.add(images_encoded=len(grid), encoder_calls=1)
        hidden = per_image[0].shape[-1] if per_image else 0
        tensors = {
            **{name: t[name] for name in PROMPT_FIELDS + IMAGE_FIELDS},
            "image_features": torch.cat(per_image) if per_image else torch.zeros((0, hidden)),
            "image_tokens": torch.tensor([len(f) for f in per_image], dtype=torch.long),
        }
        return [topic_output("vision", tensors, batch.num_samples, metadata=dict(batch.metadata))]
