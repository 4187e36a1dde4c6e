"""The step-memory benchmark's smoke run: micro-batches keep a quarter of the activations,
checkpointing far less, both the least, each with the one pass's gradients."""

from __future__ import annotations

import pytest

from tests.bench_run import run_bench_json

pytestmark = pytest.mark.slow


@pytest.mark.timeout(300)
def test_bench_step_memory_quick_json(tmp_path):
    figures, stdout = run_bench_json("bench/step_memory.py", tmp_path, 240)
    columns = figures["columns"]
    assert figures["baseline"] == "one_pass" and list(columns) == ["one_pass", "micro4", "checkpointing", "both"]
    assert [c["forwards"] for c in columns.values()] == [1, 4, 1, 4]  # 16 samples of 55 tokens, runs of 220
    assert columns["micro4"]["kept_ratio"] == pytest.approx(0.25, abs=0.01)  # a quarter of the samples at once
    assert columns["checkpointing"]["kept_ratio"] < 0.2
    assert columns["both"]["kept_mb"] < min(columns["micro4"]["kept_mb"], columns["checkpointing"]["kept_mb"])
    assert all(c["grad_diff"] < 1e-6 for c in columns.values())
    assert "grad diff" in stdout  # the human table comes first
