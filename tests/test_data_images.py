"""load_image against transformers' own Qwen2-VL image processor (PIL backend), and its errors."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import Qwen2VLConfig, Qwen3VLConfig
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from stream_rlhf.data.images import ImageError, ImageSpec, check_image_file, image_tokens, load_image

SPEC = ImageSpec(patch_size=8, temporal_patch_size=2, merge_size=2, min_pixels=16 * 16, max_pixels=64 * 64)


def _reference(image: Image.Image, spec: ImageSpec):
    processor = Qwen2VLImageProcessorPil(patch_size=spec.patch_size, merge_size=spec.merge_size,
                                         temporal_patch_size=spec.temporal_patch_size,
                                         min_pixels=spec.min_pixels, max_pixels=spec.max_pixels)
    out = processor(images=image, return_tensors="pt")
    return out["pixel_values"], out["image_grid_thw"][0]


def _random_image(width: int, height: int, mode: str = "RGB", seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    channels = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
    pixels = rng.integers(0, 256, (height, width, channels), dtype=np.uint8)
    return Image.fromarray(pixels[..., 0] if channels == 1 else pixels, mode)


@pytest.mark.parametrize(
    "width, height, mode",
    [
        (32, 32, "RGB"),    # already a multiple of 16: no resize, 4x4 patches
        (80, 48, "RGB"),    # 3840 pixels, within max_pixels: 6x10 patches
        (37, 23, "RGB"),    # rounded to 32x16, bicubic resize
        (300, 200, "RGB"),  # above max_pixels: scaled down
        (17, 16, "RGB"),    # 16x16 = min_pixels exactly
        (50, 40, "RGBA"),   # transparency composited onto white
        (40, 40, "L"),      # greyscale to RGB
    ],
)
def test_matches_transformers_processor(tmp_path, width, height, mode):
    """Bit-exact (tolerance 0): the same uint8 bicubic resize, then the same float ops in the same order."""
    image = _random_image(width, height, mode)
    path = tmp_path / "image.png"
    image.save(path)
    ours = load_image(path, SPEC)
    pixel_values, grid_thw = _reference(Image.open(path), SPEC)
    assert ours.pixel_values.dtype == torch.float32 and ours.grid_thw.dtype == torch.long
    assert torch.equal(ours.grid_thw, grid_thw)
    assert ours.pixel_values.shape == pixel_values.shape
    assert torch.equal(ours.pixel_values, pixel_values)
    t, h, w = grid_thw.tolist()
    assert ours.num_tokens == t * h * w // 4


def test_min_pixels_scales_up(tmp_path):
    spec = ImageSpec(patch_size=8, merge_size=2, min_pixels=64 * 64, max_pixels=128 * 128)
    path = tmp_path / "small.png"
    _random_image(20, 30).save(path)
    ours = load_image(path, spec)
    pixel_values, grid_thw = _reference(Image.open(path), spec)
    assert torch.equal(ours.grid_thw, grid_thw)
    assert ours.grid_thw[1] * ours.grid_thw[2] * 64 >= 64 * 64
    assert torch.equal(ours.pixel_values, pixel_values)


def test_from_vision_config():
    config = Qwen2VLConfig(vision_config={"patch_size": 8, "spatial_merge_size": 2, "temporal_patch_size": 2})
    vision = config.vision_config
    spec = ImageSpec.from_vision_config(vision, min_pixels=256, max_pixels=4096)
    assert (spec.patch_size, spec.merge_size, spec.temporal_patch_size, spec.factor) == (8, 2, 2, 16)
    with pytest.raises(ValueError, match="min_pixels"):
        ImageSpec.from_vision_config(vision, min_pixels=100, max_pixels=4096)


def test_missing_file(tmp_path):
    with pytest.raises(ImageError, match="file not found") as info:
        load_image(tmp_path / "nope.png", SPEC)
    assert info.value.kind == "missing image"


def test_not_an_image(tmp_path):
    path = tmp_path / "text.png"
    path.write_text("hello")
    with pytest.raises(ImageError, match="cannot be decoded") as info:
        load_image(path, SPEC)
    assert info.value.kind == "corrupt image"


def test_truncated_png(tmp_path):
    path = tmp_path / "cut.png"
    _random_image(64, 64).save(path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])  # the header is intact: only a full decode notices
    with pytest.raises(ImageError, match="cannot be decoded") as info:
        load_image(path, SPEC)
    assert info.value.kind == "corrupt image"


@pytest.mark.parametrize("width, height, reason", [(15, 40, "below"), (40, 8, "below"), (3400, 16, "aspect ratio")])
def test_unsupported_size(tmp_path, width, height, reason):
    path = tmp_path / "odd.png"
    Image.new("RGB", (width, height)).save(path)
    with pytest.raises(ImageError, match=reason) as info:
        load_image(path, SPEC)
    assert info.value.kind == "image size"
    assert f"{width}x{height}" in str(info.value)


def test_error_pickles():
    error = pickle.loads(pickle.dumps(ImageError("a.png", "corrupt image", "cannot be decoded (x)")))
    assert (error.path, error.kind, str(error)) == ("a.png", "corrupt image", "a.png: cannot be decoded (x)")


@pytest.mark.parametrize("width, height", [(32, 32), (80, 48), (200, 30), (20, 20)])
def test_image_tokens_from_the_header_match_the_decoded_image(tmp_path, width, height):
    path = tmp_path / "a.png"
    _random_image(width, height).save(path)
    assert image_tokens(path, SPEC) == load_image(path, SPEC).num_tokens


def test_image_tokens_leave_bad_images_to_the_decode(tmp_path):
    (tmp_path / "text.png").write_text("hello")
    Image.new("RGB", (8, 40)).save(tmp_path / "thin.png")
    assert image_tokens(tmp_path / "text.png", SPEC) is None and image_tokens(tmp_path / "thin.png", SPEC) is None


def test_check_image_file_reads_nothing(tmp_path):
    (tmp_path / "text.png").write_text("hello")
    check_image_file(tmp_path / "text.png")  # a file: whether it decodes is for load_image
    for path, reason in ((tmp_path / "nope.png", "file not found"), (tmp_path, "is a directory")):
        with pytest.raises(ImageError, match=reason) as info:
            check_image_file(path)
        assert info.value.kind == "missing image"


def _save_processor(folder, **settings) -> Qwen2VLImageProcessorPil:
    """transformers' processor with `settings`, saved as `folder`/preprocessor_config.json the way
    transformers writes it."""
    processor = Qwen2VLImageProcessorPil(patch_size=8, merge_size=2, temporal_patch_size=2, **settings)
    processor.save_pretrained(folder)
    return processor


@pytest.mark.parametrize("config_class", [Qwen2VLConfig, Qwen3VLConfig])
@pytest.mark.parametrize("width, height", [(80, 48), (300, 200), (20, 30)])
def test_model_folder_preprocessor_config_matches_transformers(tmp_path, width, height, config_class):
    """Non-default min/max pixels and mean/std read from the folder's preprocessor_config.json give
    transformers' patches, bit for bit; the image as bytes (a Parquet image column) gives the same.
    Qwen3-VL takes Qwen2-VL's image processor (transformers has none of its own)."""
    settings = {"min_pixels": 32 * 32, "max_pixels": 96 * 96, "image_mean": [0.5, 0.4, 0.3],
                "image_std": [0.2, 0.3, 0.25]}
    _save_processor(tmp_path, **settings)
    processor = Qwen2VLImageProcessorPil.from_pretrained(tmp_path)  # what a user's folder loads as
    vision = config_class(vision_config={"patch_size": 8, "spatial_merge_size": 2, "temporal_patch_size": 2})
    spec = ImageSpec.from_model_folder(tmp_path, vision.vision_config, None, None)
    assert (spec.min_pixels, spec.max_pixels) == (32 * 32, 96 * 96)
    assert spec.image_mean == (0.5, 0.4, 0.3) and spec.image_std == (0.2, 0.3, 0.25)
    path = tmp_path / "image.png"
    _random_image(width, height).save(path)
    ours = load_image(path, spec)
    reference = processor(images=Image.open(path), return_tensors="pt")
    assert torch.equal(ours.grid_thw, reference["image_grid_thw"][0])
    assert torch.equal(ours.pixel_values, reference["pixel_values"])
    assert torch.equal(load_image(path.read_bytes(), spec).pixel_values, ours.pixel_values)


def test_model_folder_config_overrides_and_defaults(tmp_path):
    vision = Qwen2VLConfig(vision_config={"patch_size": 8, "spatial_merge_size": 2, "temporal_patch_size": 2})
    no_file = ImageSpec.from_model_folder(tmp_path, vision.vision_config, None, None)
    assert (no_file.min_pixels, no_file.max_pixels, no_file.image_mean) == (16 * 16, 448 * 448, ImageSpec().image_mean)
    _save_processor(tmp_path, min_pixels=32 * 32, max_pixels=96 * 96)
    overridden = ImageSpec.from_model_folder(tmp_path, vision.vision_config, 20 * 20, None)
    assert (overridden.min_pixels, overridden.max_pixels) == (20 * 20, 96 * 96)
    other = Qwen2VLConfig(vision_config={"patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2})
    with pytest.raises(ValueError, match="patch_size=8 but the model's vision tower has 14"):
        ImageSpec.from_model_folder(tmp_path, other.vision_config, 28 * 28, 56 * 56)
