"""Images decoded when the dataset is built (`data/image_check.py`): a PNG whose signature is
valid and whose body is garbage makes its line bad before any line is sampled (before this, a
short run that never sampled the line exited 0 and said nothing), under `on_bad_sample` error
(DataError naming file:line; `stream-rlhf run` exits 2 before the warm start) and skip (counted);
each distinct file is decoded once and its outcome cached by content.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from PIL import Image

from stream_rlhf import cli
from stream_rlhf.data.image_check import CACHE_FILE, bad_images
from stream_rlhf.data.images import ImageSpec
from stream_rlhf.data.prompts_jsonl import DataError, PromptDataset
from stream_rlhf.models.tokenizer import VISION_TOKENS, build_tokenizer
from tests.rl_tiny import VISION, tiny_job, write_job

TOKENIZER = build_tokenizer(vision=True)
VISION_IDS = tuple(TOKENIZER.convert_tokens_to_ids(list(VISION_TOKENS)))
SPEC = ImageSpec(patch_size=8, temporal_patch_size=2, merge_size=2, min_pixels=16 * 16, max_pixels=64 * 64)
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _garbage_png(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(PNG_SIGNATURE + bytes(range(256)) * 4)
    return path


def _image(path: Path, width: int = 32, height: int = 32) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (width, height), (30, 200, 30)).save(path)
    return path


def _jsonl(folder: Path, images: list[str]) -> Path:
    path = folder / "train.jsonl"
    path.write_text("".join(json.dumps({"prompt": "<image>how many?", "images": [name], "answer": "1"}) + "\n"
                            for name in images))
    return path


def _dataset(path: Path, on_bad: str, cache: Path | None) -> PromptDataset:
    return PromptDataset(path, TOKENIZER, SPEC, VISION_IDS, on_bad=on_bad, max_images_per_prompt=1, seed=0,
                         image_cache=cache)


def test_a_png_with_a_garbage_body_is_found_when_the_dataset_is_built(tmp_path):
    _image(tmp_path / "images/good.png")
    _garbage_png(tmp_path / "images/bad.png")
    path = _jsonl(tmp_path, ["images/good.png", "images/good.png", "images/bad.png"])
    with pytest.raises(DataError) as info:
        _dataset(path, "error", tmp_path / "cache")
    assert info.value.source == f"{path}:3" and info.value.kind == "corrupt image"
    assert str(info.value).startswith(f"{path}:3: image images/bad.png: cannot be decoded (UnidentifiedImageError")
    skipping = _dataset(path, "skip", tmp_path / "cache")
    assert skipping.skipped == {"corrupt image": 1}  # counted before any line is sampled
    assert skipping.skipped_examples == [str(info.value)]
    assert {skipping.next_sample().source for _ in range(4)} == {f"{path}:1", f"{path}:2"}


def test_each_distinct_file_is_decoded_once_and_kept_by_its_content(tmp_path):
    good, copy = _image(tmp_path / "a.png"), tmp_path / "b.png"
    copy.write_bytes(good.read_bytes())
    thin, bad = _image(tmp_path / "thin.png", 8, 32), _garbage_png(tmp_path / "bad.png")
    found = bad_images([good, copy, thin, bad, good], SPEC, tmp_path / "cache")
    assert sorted(p.name for p in found) == ["bad.png", "thin.png"]
    assert found[thin].kind == "image size" and "size 8x32 unsupported" in found[thin].reason
    cached = json.loads((tmp_path / "cache" / CACHE_FILE).read_text())
    digest = {path.name: hashlib.sha256(path.read_bytes()).hexdigest() for path in (good, thin, bad)}
    assert cached[digest["a.png"]] == {"size": [32, 32]} and cached[digest["thin.png"]] == {"size": [8, 32]}
    assert cached[digest["bad.png"]]["kind"] == "corrupt image" and len(cached) == 3  # a.png and b.png: one entry
    # the cache answers for the content, wherever the file is: an outcome written there is what a
    # later build reads instead of decoding (and the size is checked against that build's spec)
    cached[digest["a.png"]] = {"size": [4, 4]}
    (tmp_path / "cache" / CACHE_FILE).write_text(json.dumps(cached))
    again = bad_images([copy], SPEC, tmp_path / "cache")
    assert again[copy].kind == "image size" and "size 4x4 unsupported" in again[copy].reason
    assert bad_images([copy], SPEC, None) == {}  # without the cache: decoded, and fine
    (tmp_path / "cache" / CACHE_FILE).write_text("{not json")
    assert sorted(p.name for p in bad_images([good, bad], SPEC, tmp_path / "cache")) == ["bad.png"]
    assert len(json.loads((tmp_path / "cache" / CACHE_FILE).read_text())) == 2  # started afresh


def test_run_exits_2_naming_the_line_of_a_garbage_png_before_the_warm_start(tmp_path, capsys):
    """With no warm-start step and the line not in the eval file, nothing before the stages would
    sample it: before, the run started and the prompt source met it (or never did)."""
    _image(tmp_path / "images/1.png")
    _garbage_png(tmp_path / "images/bad.png")
    train = _jsonl(tmp_path, ["images/1.png", "images/bad.png"])
    (tmp_path / "eval.jsonl").write_text(train.read_text().splitlines()[0] + "\n")
    path = write_job(tmp_path / "job.yaml", tiny_job(tmp_path, "bad", **VISION))
    code = cli.main(["run", str(path), f"--set=model.warm_start.cache_dir={tmp_path / 'warm'}",
                     "--set=model.warm_start.steps=0", f"--set=task.data_dir={tmp_path / 'cache'}",
                     f"--set=data.train={train}",
                     f"--set=data.eval={tmp_path / 'eval.jsonl'}"])
    err = capsys.readouterr().err
    assert code == 2, err[-2000:]
    assert f"data error: {train}:2: image images/bad.png: cannot be decoded" in err
    assert not (tmp_path / "warm").exists()  # no warm start began
    assert not (tmp_path / "bad").exists() or not any((tmp_path / "bad").iterdir())
