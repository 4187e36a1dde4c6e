"""An observation with images, as the ids and encoded images a vision-language episode appends.

    observe = ObservationImages(tokenizer, spec, vision_token_ids, encode=engine.encode_images)
    ids, images = observe(Observation("<image>what now?", images=("maze/2.png",)))
    # ids: vision_start, image_pad * n, vision_end, then "what now?"; images: SampleImages (n rows)
    ready = observe.many([first, second, third])   # their images in ONE call of `encode`
    ids, images = ready[0]                         # or the ValueError that observation raises

The text's <image> markers become each image's run of pad tokens, as a prompt's do
(`data/chat_template.py`: `encode_with_images`); a text without markers gets every image's run at
its start, in order (the rule is one: an observation either places all its images by markers or
none). The images are read and patched as dataset images are (`data/images.py`, the job's
`data.min_pixels` / `data.max_pixels`), and `encode` (the rollout engine's vision tower) turns the
patches into features, once per image. Any of these that fails raises ValueError (an
`ImageError` for an image file that cannot be used), which fails the episode as "malformed".
`many` does the same for several observations with one call of `encode` for all their images
(the episode loop's observations that came back together): the same ids and features as one by
one, and an observation that cannot be read gets its own ValueError without failing the others.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor
from transformers import PreTrainedTokenizerBase

from stream_rlhf.data.chat_template import encode_with_images
from stream_rlhf.data.conversation import IMAGE_MARKER
from stream_rlhf.data.images import ImageSpec, PatchedImage, load_image
from stream_rlhf.envs.environment import Observation
from stream_rlhf.samples import SampleImages

ImageEncoder = Callable[[Tensor, Tensor], list[Tensor]]
"""(pixel_values (P, D), grid_thw (n, 3)) -> each image's features (tokens_i, W); ValueError when
the engine takes no images in observations."""


class ObservationImages:
    """Observations with images to ids and `SampleImages`; see the module docstring."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, spec: ImageSpec, vision_token_ids: tuple[int, int, int],
                 encode: ImageEncoder):
        self.tokenizer, self.spec, self.vision_token_ids, self.encode = tokenizer, spec, vision_token_ids, encode

    def __call__(self, observation: Observation) -> tuple[list[int], SampleImages]:
        """The observation's ids (image runs in place) and its images' features, in token order."""
        ready = self.many([observation])[0]
        if isinstance(ready, ValueError):
            raise ready
        return ready

    def many(self, observations: Sequence[Observation]) -> list[tuple[list[int], SampleImages] | ValueError]:
        """Each observation's ids and features (as `__call__`), or the ValueError it raises; the
        images of all those that could be read go through one call of `encode`."""
        out: list[tuple[list[int], SampleImages] | ValueError | None] = [None] * len(observations)
        read: list[tuple[int, list[int], list[PatchedImage]]] = []
        for index, observation in enumerate(observations):
            try:
                read.append((index, *self._read(observation)))
            except ValueError as error:
                out[index] = error
        if not read:
            return out  # type: ignore[return-value]
        patched = [image for _, _, images in read for image in images]
        grid = torch.stack([image.grid_thw for image in patched])  # (n, 3)
        try:
            features = self.encode(torch.cat([image.pixel_values for image in patched]), grid)
        except ValueError as error:
            for index, _, _ in read:
                out[index] = error
            return out  # type: ignore[return-value]
        first = 0
        for index, ids, images in read:
            own = slice(first, first + len(images))
            out[index] = (ids, SampleImages(torch.cat(features[own]).float().cpu(), grid[own]))
            first = own.stop
        return out  # type: ignore[return-value]

    def _read(self, observation: Observation) -> tuple[list[int], list[PatchedImage]]:
        """The observation's ids and its images read and patched; ValueError for one it cannot take."""
        paths = observation.images
        text = observation.text if IMAGE_MARKER in observation.text else IMAGE_MARKER * len(paths) + observation.text
        patched = [load_image(path, self.spec) for path in paths]
        ids = encode_with_images(self.tokenizer, text, [image.num_tokens for image in patched], self.vision_token_ids,
                                 "Observation.text")
        return ids, patched
