"""The GRPO variants benchmark's smoke run works end to end and prints the figures it promises
(three of its columns: each is a job start-up), and every column's settings load."""

from __future__ import annotations

import sys

import pytest

from stream_rlhf.config import load_config
from stream_rlhf.rl.config import RLJobConfig
from tests.bench_run import REPO, run_bench_json

pytestmark = pytest.mark.slow


def test_every_columns_settings_load_and_differ_from_the_config_as_shipped():
    sys.path.insert(0, str(REPO / "bench"))
    from grpo_variants import COLUMNS, CONFIG

    shipped = load_config(RLJobConfig, CONFIG)
    for column, sets in COLUMNS.items():
        assert (load_config(RLJobConfig, CONFIG, sets) == shipped) == (column == "grpo"), column


@pytest.mark.timeout(420)
def test_bench_grpo_variants_quick_json(tmp_path):
    figures, stdout = run_bench_json("bench/grpo_variants.py", tmp_path, 400, "--columns", "overlong", "dapo")
    assert figures["baseline"] == "grpo" and figures["iterations"] == 2
    columns = figures["columns"]
    assert set(columns) == {"grpo", "overlong", "dapo"}  # the baseline always runs
    for name in ("grpo", "overlong"):
        assert columns[name]["generated"] == columns[name]["samples"] == 2 * 128  # the same samples in each
    # dapo over-samples 1.5x to train at most the baseline's groups, every one informative
    assert columns["dapo"]["generated"] == 2 * 192 and 0 < columns["dapo"]["samples"] <= 2 * 128
    for column in columns.values():
        assert 0 <= column["before"] <= 1 and 0 <= column["after"] <= 1
        assert column["gain"] == pytest.approx(column["after"] - column["before"], abs=1e-4)
    assert columns["grpo"]["before"] == columns["overlong"]["before"]  # one warm start, the same prompts
    assert columns["grpo"]["masked_truncated"] == 0 and columns["overlong"]["masked_truncated"] > 0
    assert "after / grpo" in stdout  # the human table comes first
