"""A resumed prompt source serves the prompts the interrupted one would have served next."""

from __future__ import annotations

import pytest
from PIL import Image

from stream_rlhf.stages.prompt_cursor import PromptCursors
from tests.test_data_prompts import _dataset, _good, _write


def test_a_dataset_sought_to_a_cursor_continues_as_the_original(tmp_path):
    for i in range(5):
        (tmp_path / "images").mkdir(exist_ok=True)
        Image.new("RGB", (32, 32), (200, 30, 30)).save(tmp_path / f"images/{i}.png")
    lines = [_good(i) for i in range(5)]
    lines.insert(2, _good(9))  # its image is corrupt: found bad only when sampled
    (tmp_path / "images/9.png").write_bytes(b"not a png")
    path = _write(tmp_path, lines)
    original = _dataset(path, on_bad="skip", seed=4)
    for _ in range(7):  # into the second epoch, past the bad line
        original.next_sample()
    cursors = PromptCursors(tmp_path / "run")
    cursors.record(3, {"stale": True})
    cursors.record(3, original.cursor())  # a resumed run records an iteration again: the last counts
    expected = [original.next_sample().answer for _ in range(9)]
    resumed = _dataset(path, on_bad="skip", seed=4)
    resumed.seek(cursors.at(3))
    assert [resumed.next_sample().answer for _ in range(9)] == expected
    assert resumed.skipped == original.skipped == {"corrupt image": 1}
    with pytest.raises(FileNotFoundError, match="no prompt cursor for iteration 4"):
        cursors.at(4)
