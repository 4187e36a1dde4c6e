"""The GRPO variants benchmark's smoke run works end to end and prints the figures it promises
(two of its columns: each is a job start-up), and every column's settings load."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from stream_rlhf.config import load_config
from stream_rlhf.rl.config import RLJobConfig
from tests.bench_run import REPO

pytestmark = pytest.mark.slow


def test_every_columns_settings_load_and_differ_from_the_config_as_shipped():
    sys.path.insert(0, str(REPO / "bench"))
    from grpo_variants import COLUMNS, CONFIG

    shipped = load_config(RLJobConfig, CONFIG).algorithm
    for column, sets in COLUMNS.items():
        algorithm = load_config(RLJobConfig, CONFIG, sets).algorithm
        assert (algorithm == shipped) == (column == "grpo"), column


@pytest.mark.timeout(420)
def test_bench_grpo_variants_quick_json(tmp_path):
    done = subprocess.run([sys.executable, "bench/grpo_variants.py", "--quick", "--json", "--columns", "overlong"],
                          cwd=REPO, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    assert figures["baseline"] == "grpo" and figures["iterations"] == 2
    columns = figures["columns"]
    assert set(columns) == {"grpo", "overlong"}  # the baseline always runs
    for column in columns.values():
        assert column["samples"] == 2 * 128  # the same samples in each column
        assert 0 <= column["before"] <= 1 and 0 <= column["after"] <= 1
        assert column["gain"] == pytest.approx(column["after"] - column["before"], abs=1e-4)
    assert columns["grpo"]["before"] == columns["overlong"]["before"]  # one warm start, the same prompts
    assert columns["grpo"]["masked_truncated"] == 0 and columns["overlong"]["masked_truncated"] > 0
    assert "after / grpo" in done.stdout  # the human table comes first
