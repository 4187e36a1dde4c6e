"""The shapes task: deterministic files, disjoint splits, answers that match the PNGs, rewards."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from PIL import Image

from stream_rlhf.data import shapes
from stream_rlhf.data.images import ImageSpec
from stream_rlhf.data.prompts_jsonl import PromptDataset
from stream_rlhf.models.tokenizer import ALPHABET, VISION_TOKENS, build_tokenizer


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def _squares_in(path) -> dict[tuple[int, int], str]:
    """(row, column) -> colour, read back from the PNG's pixels."""
    pixels = np.asarray(Image.open(path).convert("RGB"))
    assert pixels.shape == (shapes.IMAGE_SIZE, shapes.IMAGE_SIZE, 3)
    by_rgb = {rgb: name for name, rgb in shapes.COLORS.items()}
    found = {}
    for row in range(shapes.GRID):
        for column in range(shapes.GRID):
            cell = pixels[row * shapes.CELL:(row + 1) * shapes.CELL, column * shapes.CELL:(column + 1) * shapes.CELL]
            colours = {tuple(int(v) for v in rgb) for rgb in cell.reshape(-1, 3)}
            assert len(colours) == 1, f"cell {row} {column} is not one colour"
            rgb = colours.pop()
            if rgb != (0, 0, 0):
                found[(row, column)] = by_rgb[rgb]
    return found


def test_deterministic(tmp_path):
    one = shapes.write_split(tmp_path / "a", "train", 50, seed=3)
    two = shapes.write_split(tmp_path / "b", "train", 50, seed=3)
    other = shapes.write_split(tmp_path / "c", "train", 50, seed=4)
    assert one.read_text() == two.read_text() != other.read_text()
    for line in _lines(one):
        assert (one.parent / line["images"][0]).read_bytes() == (two.parent / line["images"][0]).read_bytes()


def test_splits_disjoint():
    train = {p.squares for p in shapes.problems("train", 3000, seed=0)}
    evaluation = {p.squares for p in shapes.problems("eval", 1000, seed=0)}
    assert not train & evaluation
    assert len(evaluation) > 500  # many distinct layouts (one-square ones repeat: only 64 exist)


def test_answers_match_images(tmp_path):
    path = shapes.write_split(tmp_path, "eval", 300, seed=1)
    kinds = set()
    for line in _lines(path):
        prompt, answer = line["prompt"], line["answer"]
        assert set(prompt.removeprefix("<image>")) <= set(ALPHABET) and set(answer) <= set(ALPHABET)
        assert prompt.startswith("<image>") and prompt.count("<image>") == 1 and len(line["images"]) == 1
        squares = _squares_in(path.parent / line["images"][0])
        assert 1 <= len(squares) <= shapes.MAX_SQUARES
        if prompt == "<image>how many?":
            kinds.add("count")
            assert answer == str(len(squares))
        elif match := re.fullmatch(r"<image>how many (\w+)\?", prompt):
            kinds.add("color count")
            assert answer == str(sum(color == match[1] for color in squares.values()))
        else:
            match = re.fullmatch(r"<image>color at (\d) (\d)\?", prompt)
            kinds.add("color at")
            assert answer == squares[(int(match[1]) - 1, int(match[2]) - 1)]
        assert len(answer) + 1 <= shapes.MAX_ANSWER_TOKENS
    assert kinds == {"count", "color count", "color at"}


def test_loads_as_prompts(tmp_path):
    """The files read back through the JSONL loader: 4 image tokens per 32x32 image."""
    path = shapes.write_split(tmp_path, "train", 20, seed=0)
    tokenizer = build_tokenizer(vision=True)
    ids = tuple(tokenizer.convert_tokens_to_ids(list(VISION_TOKENS)))
    spec = ImageSpec(patch_size=8, merge_size=2, temporal_patch_size=2, min_pixels=1024, max_pixels=1024)
    data = PromptDataset(path, tokenizer, spec, ids, on_bad="error", max_images_per_prompt=1, seed=0)
    for _ in range(20):
        sample = data.next_sample()
        assert sample.images[0].num_tokens == 4 and (sample.prompt_ids == ids[1]).sum() == 4


@pytest.mark.parametrize(
    "prompt, response, reference, expected",
    [
        ("<image>how many?", "3", "3", 1.0),
        ("<image>how many?", " 3 ", "3", 1.0),
        ("<image>how many?", "2", "3", 0.1),
        ("<image>how many red?", "0", "2", 0.1),
        ("<image>how many?", "12", "3", 0.0),
        ("<image>how many?", "red", "3", 0.0),
        ("<image>color at 1 2?", "blue", "blue", 1.0),
        ("<image>color at 1 2?", "red", "blue", 0.1),
        ("<image>color at 1 2?", "3", "blue", 0.0),
        ("<image>color at 1 2?", "bluee", "blue", 0.0),
        ("<image>color at 1 2?", "", "blue", 0.0),
    ],
)
def test_reward(prompt, response, reference, expected):
    assert shapes.reward(prompt, response, reference) == expected
