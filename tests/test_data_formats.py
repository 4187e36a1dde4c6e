"""The dataset formats: the same rows as JSONL, Parquet and a `datasets` folder give the same
samples (images as paths, or as the {bytes, path} structs `datasets` writes); `data.fields`
(nested reference, extra columns for the reward function); bad shapes named by file, row and
field, and through the CLI before anything starts (exit 2)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image

from stream_rlhf import cli
from stream_rlhf.data import shapes
from stream_rlhf.data.errors import DataError
from stream_rlhf.data.images import ImageSpec
from stream_rlhf.data.prompts_jsonl import PromptDataset
from stream_rlhf.data.shapes_parquet import write_conversations
from stream_rlhf.models.tokenizer import VISION_TOKENS, build_tokenizer
from tests.rl_tiny import VISION, tiny_job, write_job

TOKENIZER = build_tokenizer(vision=True)
VISION_IDS = tuple(TOKENIZER.convert_tokens_to_ids(list(VISION_TOKENS)))
SPEC = ImageSpec(patch_size=8, temporal_patch_size=2, merge_size=2, min_pixels=16 * 16, max_pixels=64 * 64)
FIELDS = {"reference": "reward_model.ground_truth", "level": "extra_info.level", "tags": "extra_info.tags"}


def _png(width: int, height: int, seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def _rows(folder: Path) -> list[dict]:
    """verl-like rows: a conversation with an image part, the reference nested, extra info."""
    rows = []
    for i in range(3):
        (folder / f"{i}.png").write_bytes(_png(32 + 16 * i, 48, seed=i))
        rows.append({"data_source": "shapes", "prompt": [
            {"role": "user", "content": [{"type": "image", "text": None}, {"type": "text", "text": f"how many {i}?"}]}],
            "images": [f"{i}.png"], "reward_model": {"ground_truth": str(i + 1), "style": "rule"},
            "extra_info": {"level": i, "tags": ["count", str(i)]}})
    return rows


def _open(path: Path, **kwargs) -> PromptDataset:
    return PromptDataset(path, TOKENIZER, SPEC, VISION_IDS, "error", 2, 0, **{"fields": FIELDS, **kwargs})


def _with_image_bytes(rows: list[dict], folder: Path) -> list[dict]:
    """The rows with each image as the {bytes, path} struct a `datasets` Image column stores."""
    return [{**row, "images": [{"bytes": (folder / name).read_bytes(), "path": name} for name in row["images"]]}
            for row in rows]


def _same_samples(a: PromptDataset, b: PromptDataset) -> None:
    assert len(a) == len(b)
    for index in range(len(a)):
        one, two = a.sample(index), b.sample(index)
        assert torch.equal(one.prompt_ids, two.prompt_ids) and one.answer == two.answer
        assert one.reward_kwargs == two.reward_kwargs and one.prompt == two.prompt
        assert len(one.images) == len(two.images)
        for x, y in zip(one.images, two.images):
            assert torch.equal(x.pixel_values, y.pixel_values) and torch.equal(x.grid_thw, y.grid_thw)


def test_jsonl_parquet_and_datasets_folder_give_the_same_samples(tmp_path):
    rows = _rows(tmp_path)
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    with_bytes = _with_image_bytes(rows, tmp_path)
    features = datasets.Dataset.from_list(with_bytes).features
    features["images"] = datasets.List(datasets.Image())
    hub_like = datasets.Dataset.from_list(with_bytes, features=features)
    hub_like.to_parquet(str(tmp_path / "bytes.parquet"))
    hub_like.save_to_disk(str(tmp_path / "folder"))
    jsonl = _open(tmp_path / "train.jsonl")
    sample = jsonl.sample(2)
    assert sample.answer == "3" and sample.reward_kwargs == {"level": 2, "tags": ["count", "2"]}
    assert jsonl.sources[2] == f"{tmp_path / 'train.jsonl'}:3"
    for other in ("train.parquet", "bytes.parquet", "folder"):
        dataset = _open(tmp_path / other)
        assert dataset.sources[2] == f"{tmp_path / other}:row 2"
        _same_samples(jsonl, dataset)
    assert _open(tmp_path / "folder").sample(0).image_paths == (f"{tmp_path / 'folder'}:row 0 bytes of images[0]",)


def test_todays_form_in_parquet_equals_jsonl(tmp_path):
    (tmp_path / "a.png").write_bytes(_png(32, 32, seed=0))
    rows = [{"prompt": "<image>how many?", "images": ["a.png"], "answer": "2"}, {"prompt": "1+1=", "answer": 2}]
    (tmp_path / "t.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    pq.write_table(pa.Table.from_pylist([{**row, "answer": str(row["answer"])} for row in rows]), tmp_path / "t.pq")
    _same_samples(_open(tmp_path / "t.jsonl", fields={}), _open(tmp_path / "t.pq", fields={}))


@pytest.mark.parametrize(("row", "kind", "words"), [
    ({"question": "1+1=", "answer": "2"}, "schema", 'no "messages" or "prompt" field'),
    ({"prompt": 3, "answer": "2"}, "schema", 'field "prompt": expected a string or a list of turns, got int'),
    ({"messages": [{"role": "user", "content": "1+1="}], "solution": "2"}, "schema",
     'missing field "answer" (data.fields.reference: answer)'),
    ({"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "x"}]}], "answer": "1"},
     "schema", 'field "messages[0].content[0]": an image part without an image'),
    ({"messages": [{"role": "user", "content": [{"type": "video"}]}], "answer": "1"}, "schema",
     'field "messages[0].content[0]": a part must be {"type": "text" | "image", ...}'),
    ({"messages": [{"content": "x"}], "answer": "1"}, "schema", 'field "messages[0]": a turn must be'),
    ({"messages": [{"role": "user", "content": "x"}], "images": ["a.png"], "answer": "1"}, "image tokens",
     '1 image(s) in "images" but 0 image part(s) take one'),
    ({"messages": [{"role": "user", "content": [{"type": "image", "image": 5}]}], "answer": "1"}, "schema",
     'field "messages[0].content[0].image": an image must be a path, bytes or {bytes, path}, got int'),
])
def test_bad_rows_name_file_row_and_field(tmp_path, row, kind, words):
    (tmp_path / "a.png").write_bytes(_png(32, 32, seed=0))
    good = {"messages": [{"role": "user", "content": "1+1="}], "answer": "2"}
    pq.write_table(pa.Table.from_pylist([good, good]), tmp_path / "good.parquet")
    (tmp_path / "t.jsonl").write_text(json.dumps(good) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(DataError) as error:
        _open(tmp_path / "t.jsonl", fields={})
    assert str(error.value) == f"{tmp_path / 't.jsonl'}:2: " + error.value.reason and words in error.value.reason
    assert error.value.kind == kind
    skipped = PromptDataset(tmp_path / "t.jsonl", TOKENIZER, SPEC, VISION_IDS, "skip", 2, 0)
    assert skipped.skipped == {kind: 1} and len(list(skipped.each_sample())) == 1


def test_extra_columns_must_travel_as_json(tmp_path):
    table = pa.table({"prompt": ["1+1="], "answer": ["2"], "when": pa.array([1], pa.timestamp("s"))})
    pq.write_table(table, tmp_path / "t.parquet")
    with pytest.raises(DataError, match=r't.parquet:row 0: field "when": datetime values cannot reach the reward'):
        _open(tmp_path / "t.parquet", fields={"when": "when"})


def test_whole_dataset_problems(tmp_path):
    (tmp_path / "x.parquet").write_text("not parquet")
    with pytest.raises(DataError, match="x.parquet: cannot be read as Parquet") as error:
        _open(tmp_path / "x.parquet")
    assert error.value.kind == "file"
    splits = datasets.DatasetDict({"train": datasets.Dataset.from_list([{"prompt": "1", "answer": "1"}])})
    splits.save_to_disk(str(tmp_path / "splits"))
    with pytest.raises(DataError, match=r"splits: holds the splits \['train'\]: name one split's folder"):
        _open(tmp_path / "splits")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="empty: is not a folder written by datasets' save_to_disk"):
        _open(tmp_path / "empty")


def test_the_cli_names_a_bad_parquet_row_before_anything_starts(tmp_path, capsys):
    """A conversational Parquet dataset whose second row has an image part without an image: exit
    2 naming file, row and field; no warm start began, no stage wrote into the run folder."""
    (tmp_path / "a.png").write_bytes(_png(32, 32, seed=0))
    part = {"type": "image", "text": None}
    good = {"messages": [{"role": "user", "content": [part, {"type": "text", "text": "how many?"}]}],
            "images": ["a.png"], "solution": "1"}
    bad = {**good, "images": []}
    pq.write_table(pa.Table.from_pylist([good, bad]), tmp_path / "train.parquet")
    pq.write_table(pa.Table.from_pylist([good]), tmp_path / "eval.parquet")
    path = write_job(tmp_path / "job.yaml", tiny_job(tmp_path, "bad", **VISION))
    sets = [f"model.warm_start.cache_dir={tmp_path / 'cache'}", f"data.train={tmp_path / 'train.parquet'}",
            f"data.eval={tmp_path / 'eval.parquet'}", "data.fields={reference: solution}"]
    code = cli.main(["run", str(path), *(f"--set={s}" for s in sets)])
    err = capsys.readouterr().err
    assert code == 2, err[-2000:]
    assert (f'data error: {tmp_path / "train.parquet"}:row 1: field "messages[0].content[0]": an image part '
            "without an image") in err
    assert not (tmp_path / "cache").exists()
    assert not (tmp_path / "bad").exists() or not any((tmp_path / "bad").iterdir())


def test_the_shapes_parquet_example_gives_the_shapes_jsonl_samples(tmp_path):
    """docs/data.md's example dataset: the same prompts, images and answers as the shapes task's JSONL."""
    shapes.write_split(tmp_path / "jsonl", "eval", 6, seed=3)
    write_conversations(tmp_path / "parquet", "eval", 6, seed=3)
    jsonl = PromptDataset(tmp_path / "jsonl/eval.jsonl", TOKENIZER, SPEC, VISION_IDS, "error", 1, 0)
    parquet = PromptDataset(tmp_path / "parquet/eval.parquet", TOKENIZER, SPEC, VISION_IDS, "error", 1, 0,
                            fields={"reference": "solution"})
    for index in range(6):
        one, two = jsonl.sample(index), parquet.sample(index)
        assert torch.equal(one.prompt_ids, two.prompt_ids) and one.answer == two.answer
        assert torch.equal(one.images[0].pixel_values, two.images[0].pixel_values)
