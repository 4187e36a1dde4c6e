"""The JSONL prompt dataset: encoding, every bad-line case in both modes, epochs, paths."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
from PIL import Image

from stream_rlhf.data.images import ImageSpec
from stream_rlhf.data.prompts_jsonl import DataError, PromptDataset, encode_prompt
from stream_rlhf.models.tokenizer import VISION_TOKENS, build_tokenizer

TOKENIZER = build_tokenizer(vision=True)
VISION_IDS = tuple(TOKENIZER.convert_tokens_to_ids(list(VISION_TOKENS)))
START, PAD, END = VISION_IDS
SPEC = ImageSpec(patch_size=8, temporal_patch_size=2, merge_size=2, min_pixels=16 * 16, max_pixels=64 * 64)


def _image(path: Path, width: int = 32, height: int = 32) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (width, height), (200, 30, 30)).save(path)


def _write(folder: Path, lines: list) -> Path:
    """Lines are dicts (written as JSON) or raw strings."""
    path = folder / "train.jsonl"
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def _dataset(path: Path, on_bad: str = "error", max_images: int = 2, seed: int = 0) -> PromptDataset:
    return PromptDataset(path, TOKENIZER, SPEC, VISION_IDS, on_bad=on_bad, max_images_per_prompt=max_images, seed=seed)


def _good(i: int) -> dict:
    return {"prompt": f"<image>how many {i}?", "images": [f"images/{i}.png"], "answer": str(i)}


def test_encode_prompt():
    ids = encode_prompt(TOKENIZER, "a<image>b<image>", [4, 2], VISION_IDS).tolist()
    a, b = TOKENIZER.convert_tokens_to_ids(["a", "b"])
    assert ids == [TOKENIZER.bos_token_id, a, START, PAD, PAD, PAD, PAD, END, b, START, PAD, PAD, END]
    assert encode_prompt(TOKENIZER, "ab", [], VISION_IDS).tolist() == [TOKENIZER.bos_token_id, a, b]
    with pytest.raises(ValueError, match="2 <image> markers for 1 image"):
        encode_prompt(TOKENIZER, "<image><image>", [4], VISION_IDS)
    with pytest.raises(ValueError, match="vision special token"):
        encode_prompt(TOKENIZER, "<image>x<|image_pad|>", [4], VISION_IDS)
    with pytest.raises(ValueError, match=">= 1"):
        encode_prompt(TOKENIZER, "<image>", [0], VISION_IDS)


def test_round_trip(tmp_path):
    _image(tmp_path / "images/1.png")
    _image(tmp_path / "images/2.png", 48, 80)
    path = _write(tmp_path, [
        _good(1),
        "",  # blank lines are ignored
        {"prompt": "<image>and<image>?", "images": ["images/1.png", "images/2.png"], "answer": "x"},
        {"prompt": "text only", "answer": "y"},
    ])
    data = _dataset(path)
    assert len(data) == 3 and data.sources == [f"{path}:1", f"{path}:3", f"{path}:4"]
    one, two, text = data.sample(0), data.sample(1), data.sample(2)
    assert one.source == f"{path}:1" and one.answer == "1" and one.prompt == "<image>how many 1?"
    assert (one.prompt_ids == PAD).sum() == 4 and one.images[0].num_tokens == 4
    assert one.prompt_ids[:3].tolist() == [TOKENIZER.bos_token_id, START, PAD]
    assert TOKENIZER.decode(one.prompt_ids[7:]) == "how many 1?"
    assert [image.num_tokens for image in two.images] == [4, 15]  # 48x80: 6x10 patches
    assert (two.prompt_ids == PAD).sum() == 19 and (two.prompt_ids == START).sum() == 2
    assert text.images == [] and TOKENIZER.decode(text.prompt_ids[1:]) == "text only"


def test_relative_and_absolute_paths(tmp_path):
    _image(tmp_path / "data/images/1.png")
    _image(tmp_path / "elsewhere.png")
    (tmp_path / "data").mkdir(exist_ok=True)
    path = _write(tmp_path / "data", [_good(1), {"prompt": "<image>", "images": [str(tmp_path / "elsewhere.png")],
                                                  "answer": ""}])
    data = _dataset(path)
    assert data.sample(0).images[0].num_tokens == 4 and data.sample(1).images[0].num_tokens == 4


# (line as written, kind, words of the message); images/1.png exists, images/cut.png is truncated
BAD_LINES = [
    ('{"prompt": "<image>x", "images": ["images/1.png"], "answer": "1"', "json", "not valid JSON"),
    ('[1, 2]', "schema", "expected a JSON object, got list"),
    ({"prompt": "<image>x", "images": ["images/1.png"]}, "schema", 'missing key "answer"'),
    ({"prompt": "<image>x", "image": ["images/1.png"], "answer": "1"}, "schema", 'unknown key "image"'),
    ({"prompt": "x", "answer": 2}, "schema", 'key "answer" must be a string, got int'),
    ({"prompt": "x", "images": "images/1.png", "answer": "1"}, "schema", 'key "images" must be a list'),
    ({"prompt": "", "answer": "1"}, "schema", 'key "prompt" is empty'),
    ({"prompt": "<image><image>x", "images": ["images/1.png"], "answer": "1"}, "image tokens",
     "prompt has 2 <image> markers for 1 image(s)"),
    ({"prompt": "<image>x<|image_pad|>", "images": ["images/1.png"], "answer": "1"}, "image tokens",
     "<|image_pad|>"),
    ({"prompt": "<image><image><image>", "images": ["images/1.png"] * 3, "answer": "1"}, "image tokens",
     "too many images: 3 > max_images_per_prompt=2"),
    ({"prompt": "<image>x", "images": ["images/3.png"], "answer": "1"}, "missing image",
     "image images/3.png: file not found"),
    ({"prompt": "<image>x", "images": ["images/cut.png"], "answer": "1"}, "corrupt image",
     "image images/cut.png: cannot be decoded"),
    ({"prompt": "<image>x", "images": ["images/thin.png"], "answer": "1"}, "image size",
     "image images/thin.png: size 8x32 unsupported"),
]


def _bad_setup(tmp_path: Path, bad) -> Path:
    _image(tmp_path / "images/1.png")
    _image(tmp_path / "images/2.png")
    _image(tmp_path / "images/thin.png", 8, 32)
    _image(tmp_path / "images/cut.png", 64, 64)
    data = (tmp_path / "images/cut.png").read_bytes()
    (tmp_path / "images/cut.png").write_bytes(data[: len(data) // 2])
    return _write(tmp_path, [_good(1), "", bad, _good(2)])  # the bad line is line 3


@pytest.mark.parametrize("bad, kind, words", BAD_LINES, ids=[f"{case[1]}-{i}" for i, case in enumerate(BAD_LINES)])
def test_bad_line_error_mode(tmp_path, bad, kind, words):
    path = _bad_setup(tmp_path, bad)
    with pytest.raises(DataError) as info:
        data = _dataset(path)
        for _ in range(3):
            data.next_sample()
    assert str(info.value).startswith(f"{path}:3: ") and words in str(info.value)
    assert info.value.kind == kind and info.value.source == f"{path}:3"


@pytest.mark.parametrize("bad, kind, words", BAD_LINES, ids=[f"{case[1]}-{i}" for i, case in enumerate(BAD_LINES)])
def test_bad_line_skip_mode(tmp_path, bad, kind, words):
    path = _bad_setup(tmp_path, bad)
    data = _dataset(path, on_bad="skip")
    answers = [data.next_sample().answer for _ in range(6)]  # three epochs of the two good lines
    assert sorted(answers) == ["1", "1", "1", "2", "2", "2"]
    assert data.skipped == {kind: 1}  # counted once, never retried
    assert len(data.skipped_examples) == 1
    assert data.skipped_examples[0].startswith(f"{path}:3: ") and words in data.skipped_examples[0]


def _corrupt_png(path: Path) -> None:
    _image(path, 64, 64)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])  # the header reads, the pixels do not


def test_all_bad(tmp_path):
    _corrupt_png(tmp_path / "images/cut.png")
    path = _write(tmp_path, ["{", {"prompt": "<image>", "images": ["images/9.png"], "answer": "1"},
                             {"prompt": "<image>", "images": ["images/cut.png"], "answer": "1"}])
    with pytest.raises(DataError, match=r"no usable lines in .*train.jsonl \(3 skipped: 1 corrupt image, 1 json, "
                                        r"1 missing image\)"):
        _dataset(path, on_bad="skip")  # every line is found bad when the file is read
    path = _write(tmp_path, ["{", "[]"])
    with pytest.raises(DataError, match=r"no usable lines .*\(2 skipped: 1 json, 1 schema\)"):
        _dataset(path, on_bad="skip")


def test_empty_and_missing_file(tmp_path):
    for text in ("", "\n  \n"):
        (tmp_path / "empty.jsonl").write_text(text)
        with pytest.raises(DataError, match="empty.jsonl: no lines"):
            _dataset(tmp_path / "empty.jsonl")
    with pytest.raises(DataError, match="nope.jsonl: cannot be read"):
        _dataset(tmp_path / "nope.jsonl")


def test_epochs_cover_every_good_line_once(tmp_path):
    for i in range(7):
        _image(tmp_path / f"images/{i}.png")
    lines = [_good(i) for i in range(7)]
    lines.insert(3, {"prompt": "<image>", "images": ["images/missing.png"], "answer": "9"})
    data = _dataset(_write(tmp_path, lines), on_bad="skip", seed=3)
    epochs = [[data.next_sample().answer for _ in range(7)] for _ in range(3)]
    for epoch in epochs:
        assert sorted(epoch) == [str(i) for i in range(7)]
    assert epochs[0] != epochs[1] or epochs[1] != epochs[2]  # reshuffled
    assert data.skipped == {"missing image": 1} and data.epoch in (2, 3)
    again = _dataset(_write(tmp_path, lines), on_bad="skip", seed=3)
    assert [again.next_sample().answer for _ in range(7)] == epochs[0]  # deterministic given the seed


def test_data_error_pickles():
    error = pickle.loads(pickle.dumps(DataError("a.jsonl:4", "json", "not valid JSON (x)")))
    assert (error.source, error.kind, str(error)) == ("a.jsonl:4", "json", "a.jsonl:4: not valid JSON (x)")


def test_text_only_model(tmp_path):
    _image(tmp_path / "images/1.png")
    path = _write(tmp_path, [{"prompt": "1+2=", "answer": "3"}, _good(1)])
    data = PromptDataset(path, TOKENIZER, None, None, on_bad="skip", max_images_per_prompt=1, seed=0)
    assert TOKENIZER.decode(data.next_sample().prompt_ids[1:]) == "1+2="
    assert data.skipped == {"image tokens": 1} and "the model takes none" in data.skipped_examples[0]
    with pytest.raises(ValueError, match="give both"):
        PromptDataset(path, TOKENIZER, SPEC, None, on_bad="skip", max_images_per_prompt=1, seed=0)


def test_missing_and_corrupt_images_are_found_when_the_file_is_read(tmp_path):
    _image(tmp_path / "images/1.png")
    _corrupt_png(tmp_path / "images/cut.png")
    missing = _write(tmp_path, [_good(1), {"prompt": "<image>", "images": ["images/gone.png"], "answer": "1"}])
    with pytest.raises(DataError, match=r"train.jsonl:2: image images/gone.png: file not found"):
        _dataset(missing)  # no line sampled yet
    corrupt = _write(tmp_path, [_good(1), {"prompt": "<image>", "images": ["images/cut.png"], "answer": "1"}])
    with pytest.raises(DataError, match=r"train.jsonl:2: image images/cut.png: cannot be decoded"):
        _dataset(corrupt)
    assert _dataset(corrupt, on_bad="skip").skipped == {"corrupt image": 1}


def test_training_counts_a_corrupt_image_by_the_same_rule_as_eval(tmp_path):
    """The prompt source (training, `next_sample`) and the evaluation (`each_sample`) apply
    `on_bad` alike to an image that only fails when decoded."""
    for i in range(3):
        _image(tmp_path / f"images/{i}.png")
    _corrupt_png(tmp_path / "images/cut.png")
    path = _write(tmp_path, [_good(0), {"prompt": "<image>x", "images": ["images/cut.png"], "answer": "9"},
                             _good(1), _good(2)])
    training, evaluation = _dataset(path, on_bad="skip"), _dataset(path, on_bad="skip")
    trained = [training.next_sample().answer for _ in range(6)]
    evaluated = [sample.answer for sample in evaluation.each_sample()]
    assert sorted(trained) == ["0", "0", "1", "1", "2", "2"] and evaluated == ["0", "1", "2"]
    assert training.skipped == evaluation.skipped == {"corrupt image": 1}
    assert training.skipped_examples == evaluation.skipped_examples
    assert training.skipped_examples[0].startswith(f"{path}:2: image images/cut.png: cannot be decoded")
    with pytest.raises(DataError, match=f"{path}:2: image images/cut.png: cannot be decoded"):
        _dataset(path)  # error mode: when the dataset is built, for training and evaluation alike


def test_longest_prompt_counts_image_tokens_from_headers(tmp_path):
    _image(tmp_path / "images/1.png")
    _image(tmp_path / "images/2.png", 48, 80)  # 6x10 patches: 15 image tokens
    path = _write(tmp_path, [_good(1), {"prompt": "<image>and<image>?", "images": ["images/1.png", "images/2.png"],
                                        "answer": "x"}, {"prompt": "text only", "answer": "y"}])
    data = _dataset(path)
    assert data.longest_prompt() == (len(data.sample(1).prompt_ids), f"{path}:2")
    assert len(data.sample(1).prompt_ids) == 1 + 2 + 4 + 3 + 2 + 15 + 1
