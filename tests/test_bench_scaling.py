"""The scaling benchmark's smoke run works end to end and prints the keys it promises."""

from __future__ import annotations

import os

import pytest

from tests.bench_run import run_bench_json

pytestmark = pytest.mark.slow
COLUMNS = ("one_rank_one_thread", "one_rank_two_threads", "two_ranks_one_thread")


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="the benchmark's columns need two cores")
def test_bench_scaling_quick_json(tmp_path):
    figures, stdout = run_bench_json("bench/scaling.py", tmp_path, timeout_s=240)
    assert figures["device"] == "cpu" and figures["params"] > 0 and figures["tokens_per_step"] == 16 * 32
    for column in COLUMNS:  # speed itself: bench/RESULTS.md
        assert figures[f"{column}_tokens_per_s"] > 0, column
    assert figures["ratio_2ranks"] == pytest.approx(
        figures["two_ranks_one_thread_tokens_per_s"] / figures["one_rank_one_thread_tokens_per_s"], rel=1e-2)
    assert "two ranks one thread" in stdout  # the human table comes first
