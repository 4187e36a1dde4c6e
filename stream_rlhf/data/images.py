"""Image files to the patches a Qwen2-VL vision tower takes, exactly as transformers' Qwen2-VL image
processor makes them (PIL decode, smart resize, rescale, normalise, patchify), without its machinery.

    spec = ImageSpec.from_vision_config(model.config.vision_config, min_pixels=16 * 16, max_pixels=64 * 64)
    image = load_image("images/000001.png", spec)
    image.pixel_values   # (num_patches, C * temporal_patch_size * patch_size**2) float32
    image.grid_thw       # (3,) long: (1, height // patch_size, width // patch_size)
    image.num_tokens     # image tokens the language model sees: num_patches // merge_size**2

Supported images (anything else raises `ImageError` with kind "image size"): both sides at least
`factor = patch_size * merge_size` pixels and an aspect ratio (long side / short side) of at most
200, the limit of Qwen's `smart_resize`; Pillow's decompression-bomb limit (about 179M pixels)
also applies. A supported image is resized (bicubic) to the nearest height and width that are
multiples of `factor`, scaled down when that exceeds `max_pixels` and up when it falls below
`min_pixels` (Qwen's rule: at least one `factor` per side, so a very elongated image may end just
above `max_pixels`).

The patch order matches transformers: patches are grouped by merge windows (the merge_size x
merge_size patches that become one image token are consecutive), and each patch holds the single
frame repeated temporal_patch_size times, flattened as (C, T, p, p).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
MAX_ASPECT_RATIO = 200


class ImageError(ValueError):
    """An image that cannot be used. `kind` is "missing image", "corrupt image" or "image size";
    `reason` is the message without the path."""

    def __init__(self, path: str | Path, kind: str, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path, self.kind, self.reason = str(path), kind, reason

    def __reduce__(self):  # picklable across processes despite the custom __init__
        return type(self), (self.path, self.kind, self.reason)


@dataclass(frozen=True)
class ImageSpec:
    """How images become patches; the defaults are Qwen2-VL's image processor's."""

    patch_size: int = 14
    """Side of one square vision patch, in pixels."""
    temporal_patch_size: int = 2
    """Frames per patch; a still image is repeated this many times."""
    merge_size: int = 2
    """merge_size x merge_size neighbouring patches become one image token of the language model."""
    min_pixels: int = 56 * 56
    """Images with fewer pixels are scaled up."""
    max_pixels: int = 28 * 28 * 1280
    """Images with more pixels are scaled down."""
    image_mean: tuple[float, float, float] = OPENAI_CLIP_MEAN
    image_std: tuple[float, float, float] = OPENAI_CLIP_STD

    def __post_init__(self) -> None:
        for name in ("patch_size", "temporal_patch_size", "merge_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: must be >= 1")
        if self.min_pixels < self.factor**2:
            raise ValueError(f"min_pixels={self.min_pixels}: "
                             f"must be >= (patch_size * merge_size)**2 = {self.factor**2}")
        if self.max_pixels < self.min_pixels:
            raise ValueError(f"max_pixels={self.max_pixels}: must be >= min_pixels={self.min_pixels}")
        if len(self.image_mean) != 3 or len(self.image_std) != 3 or min(self.image_std) <= 0:
            raise ValueError(f"image_mean={self.image_mean}, image_std={self.image_std}: need 3 values each, std > 0")

    @property
    def factor(self) -> int:
        """Resized sides are multiples of this many pixels (one image token's side)."""
        return self.patch_size * self.merge_size

    @classmethod
    def from_vision_config(cls, vision_config, min_pixels: int, max_pixels: int) -> ImageSpec:
        """The spec of a transformers Qwen2-VL or Qwen2.5-VL vision config (`model.config.vision_config`)."""
        return cls(patch_size=vision_config.patch_size, temporal_patch_size=vision_config.temporal_patch_size,
                   merge_size=vision_config.spatial_merge_size, min_pixels=min_pixels, max_pixels=max_pixels)


@dataclass
class PatchedImage:
    pixel_values: torch.Tensor
    """(num_patches, C * temporal_patch_size * patch_size**2) float32, in merge-window order."""
    grid_thw: torch.Tensor
    """(3,) long: (temporal, height, width) in patches."""
    merge_size: int

    @property
    def num_tokens(self) -> int:
        """Image tokens the language model sees for this image."""
        t, h, w = self.grid_thw.tolist()
        return t * h * w // self.merge_size**2


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Qwen2-VL's target size: sides multiples of `factor`, pixels near [min_pixels, max_pixels],
    aspect ratio kept (transformers' `smart_resize`, minus its aspect-ratio check, done by the caller)."""
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def load_image(path: str | Path, spec: ImageSpec) -> PatchedImage:
    """Decode, check, resize and patchify the image file at `path` (raises `ImageError`)."""
    image = decode_image(path)
    width, height = image.size
    check_size(path, width, height, spec)
    new_height, new_width = smart_resize(height, width, spec.factor, spec.min_pixels, spec.max_pixels)
    image = image.resize((new_width, new_height), resample=Image.Resampling.BICUBIC)
    return patchify(np.asarray(image), spec)


def check_size(path: str | Path, width: int, height: int, spec: ImageSpec) -> None:
    """Raise ImageError "image size" when `load_image` does not support a `width` x `height` image."""
    if min(height, width) < spec.factor:
        raise ImageError(path, "image size", f"size {width}x{height} unsupported: a side is below "
                         f"patch_size * merge_size = {spec.factor} pixels")
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ImageError(path, "image size", f"size {width}x{height} unsupported: aspect ratio "
                         f"{max(height, width) / min(height, width):.0f} > {MAX_ASPECT_RATIO}")


def check_image_file(path: str | Path) -> None:
    """Raise ImageError "missing image" when no file is at `path` (a cheap check: nothing is read)."""
    path = Path(path)
    if path.is_dir():
        raise ImageError(path, "missing image", "is a directory, not an image file")
    if not path.is_file():
        raise ImageError(path, "missing image", "file not found")


def image_tokens(path: str | Path, spec: ImageSpec) -> int | None:
    """The image tokens `load_image` would make of the image at `path`, from its header alone
    (no pixels decoded); None when the header cannot be read or the size is unsupported (the
    decode, when the image is used, says why)."""
    try:
        with Image.open(path) as opened:
            width, height = opened.size
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError):
        return None
    if min(height, width) < spec.factor or max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        return None
    new_height, new_width = smart_resize(height, width, spec.factor, spec.min_pixels, spec.max_pixels)
    return new_height * new_width // spec.factor**2


def decode_image(path: str | Path) -> Image.Image:
    """The fully decoded RGB image at `path`; transparency is composited onto white as transformers does."""
    try:
        with Image.open(path) as opened:
            opened.load()  # a truncated or corrupt file fails here, not later
            image = opened
    except FileNotFoundError:
        raise ImageError(path, "missing image", "file not found") from None
    except IsADirectoryError:
        raise ImageError(path, "missing image", "is a directory, not an image file") from None
    except Image.DecompressionBombError as error:
        raise ImageError(path, "image size", f"size unsupported: {error}") from None
    except (OSError, ValueError, SyntaxError) as error:  # PIL's UnidentifiedImageError is an OSError
        raise ImageError(path, "corrupt image", f"cannot be decoded ({type(error).__name__}: {error})") from None
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    return image.convert("RGB")


def patchify(rgb: np.ndarray, spec: ImageSpec) -> PatchedImage:
    """(H, W, 3) uint8 with sides multiples of `spec.factor` -> rescaled, normalised patches."""
    image = np.moveaxis(rgb, -1, 0).astype(np.float64) * (1 / 255)  # (C, H, W), as transformers rescales
    image = image.astype(np.float32)
    mean, std = np.array(spec.image_mean, dtype=np.float32), np.array(spec.image_std, dtype=np.float32)
    image = ((image.T - mean) / std).T
    channels, height, width = image.shape
    p, m, t = spec.patch_size, spec.merge_size, spec.temporal_patch_size
    grid_h, grid_w = height // p, width // p
    patches = image.reshape(channels, grid_h // m, m, p, grid_w // m, m, p)
    patches = patches.transpose(1, 4, 2, 5, 0, 3, 6)  # (gh/m, gw/m, m, m, C, p, p)
    patches = np.broadcast_to(patches[:, :, :, :, :, None], (*patches.shape[:5], t, p, p))  # repeat the frame
    pixel_values = torch.from_numpy(np.ascontiguousarray(patches).reshape(grid_h * grid_w, channels * t * p * p))
    return PatchedImage(pixel_values, torch.tensor([1, grid_h, grid_w], dtype=torch.long), m)
