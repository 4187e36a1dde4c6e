"""How images travel between stages, and how a stage gets the features of a mini-batch.

The prompt source decodes and patches the images of a mini-batch once; its handle carries

    pixel_values        (P, D) float32   every image's patches, image after image
    image_grid_thw      (n, 3) long      each image's patch grid
    prompt_images       ragged long      per sample: indices of its images, in prompt order

and the vision stage replaces `pixel_values` with `image_features` (T, W), the vision tower's
output (one row per image token; Qwen3-VL's with its deepstack features beside it,
`models/vision_language.py`), and `image_tokens` (n,), the rows of each image. Rollout, the
forwards and the trainers read that handle (`ImageInputs.of`) and never run the vision tower. With
`vision.prefetch: false` they get the prompt source's handle instead and run the tower themselves,
counting each call.

An `env` job's episodes may add images in their observations: the rollout encodes those (the
torch engine with its policy's vision tower, vLLM's through `ImageInputs.encode`, a tower loaded in
the rollout process at the first such image; `envs/observation_images.py`) and its handle carries them as
`episode_image_features` / `episode_image_grid_thw` (`envs/episode_handle.py`); `ImageInputs.of`
puts each sample's after its prompt images, so every consumer sees the episode's whole image list.
"""

from __future__ import annotations

import torch
from torch import Tensor

from stream_rlhf.backends.forward_engine import VisionTowerEngine
from stream_rlhf.samples import SampleImages, ragged, unragged
from stream_rlhf.stages.job_context import JobContext
from stream_rlhf.telemetry.stage_counts import StageCounts

IMAGE_FIELDS = ("image_grid_thw", "prompt_images", "prompt_images_lens")
"""The fields a features handle shares with the prompt source's handle."""


def image_batch_fields(images: list, sample_images: list[list[int]]) -> dict[str, Tensor]:
    """The prompt source's image fields from the mini-batch's decoded images (`PatchedImage`s)
    and each sample's indices into them."""
    pixel_values = torch.cat([im.pixel_values for im in images]) if images else torch.zeros(0)
    grid = torch.stack([im.grid_thw for im in images]) if images else torch.zeros((0, 3), dtype=torch.long)
    return {
        "pixel_values": pixel_values,
        "image_grid_thw": grid,
        **ragged("prompt_images", [torch.tensor(ix, dtype=torch.long) for ix in sample_images]),
    }


class ImageInputs:
    """The image features of each sample of a mini-batch, for one stage.

    `of(tensors)` returns one `SampleImages` per sample (None for a text model). Features come
    from the handle when the vision stage computed them; otherwise this stage's own copy of the
    vision tower encodes `pixel_values`, and `counts` records `images_encoded`. `encode` runs that
    copy on images of the stage's own (an episode's observation), loading it at its first call.
    """

    def __init__(self, job: JobContext, counts: StageCounts, device: torch.device | str = "cpu"):
        """`device`: where this stage's own vision tower runs (without the vision stage)."""
        self.enabled = job.vision_language
        self.counts = counts
        self.checkpoint, self.device = job.checkpoint, device
        self.tower: VisionTowerEngine | None = None
        if self.enabled and not job.config.vision.prefetch:
            self.tower = VisionTowerEngine(job.checkpoint, device)

    def encode(self, pixel_values: Tensor, grid_thw: Tensor) -> list[Tensor]:
        """One (tokens_i, W) feature tensor per image, from this stage's frozen copy of the vision
        tower (the vision stage's weights and precision), counted as `images_encoded`; ValueError
        for a text model."""
        if not self.enabled:
            raise ValueError("the policy is a text model: it takes no images")
        if self.tower is None:
            self.tower = VisionTowerEngine(self.checkpoint, self.device)
        features = self.tower.image_features(pixel_values, grid_thw)
        self.counts.add(images_encoded=len(grid_thw), encoder_calls=1)
        return features

    def of(self, tensors: dict[str, Tensor]) -> list[SampleImages] | None:
        if not self.enabled:
            return None
        grid = tensors["image_grid_thw"].long()
        if "image_features" in tensors:
            per_image = list(torch.split(tensors["image_features"], tensors["image_tokens"].tolist()))
            self.counts.add(images_read=len(grid))
        else:
            if self.tower is None:
                raise RuntimeError("a handle without image_features reached a stage that has no vision tower "
                                   "(vision.prefetch is on but the vision stage did not run)")
            per_image = self.tower.image_features(tensors["pixel_values"], grid)
            self.counts.add(images_encoded=len(grid), encoder_calls=1)
        return with_observation_images(samples_of(per_image, grid, unragged(tensors, "prompt_images")), tensors)


def samples_of(per_image: list[Tensor], grid: Tensor, sample_images: list[Tensor]) -> list[SampleImages]:
    """Each sample's images, from the mini-batch's per-image features."""
    hidden = per_image[0].shape[-1] if per_image else 0
    out = []
    for index in sample_images:
        index = index.long().tolist()
        features = torch.cat([per_image[i] for i in index]) if index else torch.zeros((0, hidden))
        out.append(SampleImages(features, grid[index]))
    return out


def with_observation_images(samples: list[SampleImages], tensors: dict[str, Tensor]) -> list[SampleImages]:
    """Each sample's prompt images followed by its episode's observation images (when the handle
    has them: `env` jobs whose observations showed images)."""
    if "episode_image_features" not in tensors:
        return samples
    features, grids = unragged(tensors, "episode_image_features"), unragged(tensors, "episode_image_grid_thw")
    return [images.followed_by(SampleImages(f, g.long()))
            for images, f, g in zip(samples, features, grids, strict=True)]
