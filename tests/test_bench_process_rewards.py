"""The process-rewards benchmark's smoke run works end to end and prints the figures it promises."""

from __future__ import annotations

import pytest

from tests.bench_run import run_bench_json

pytestmark = pytest.mark.slow


@pytest.mark.timeout(420)
def test_bench_process_rewards_quick_json(tmp_path):
    figures, stdout = run_bench_json("bench/process_rewards.py", tmp_path, timeout_s=400)
    assert figures["baseline"] == "outcome" and figures["iterations"] == 2
    assert set(figures["columns"]) == {"outcome", "rule_prm"}
    for column in figures["columns"].values():
        assert column["samples"] == 2 * 256  # the same samples in each column
        assert 0 <= column["before"] <= 1 and 0 <= column["after"] <= 1
        assert column["gain"] == pytest.approx(column["after"] - column["before"], abs=1e-4)
    # both columns start from the same warm start and evaluate it on the same prompts
    assert figures["columns"]["outcome"]["before"] == figures["columns"]["rule_prm"]["before"]
    assert "after / outcome" in stdout  # the human table comes first
