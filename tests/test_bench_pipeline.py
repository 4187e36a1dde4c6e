"""The pipeline benchmark's smoke run works end to end and prints the keys it promises."""

from __future__ import annotations

import pytest

from tests.bench_run import run_bench_json

pytestmark = pytest.mark.slow


KEYS = {
    "sync_tokens_per_s", "stream0_tokens_per_s", "stream1_tokens_per_s", "stream1_over_sync",
    "bubble_ratio_sync", "bubble_ratio_stream1",
}


@pytest.mark.timeout(900)  # ~100 s on a quiet 2-core machine, several times that on a loaded one
def test_bench_pipeline_quick_json(tmp_path):
    figures, stdout = run_bench_json("bench/pipeline.py", tmp_path, timeout_s=840)
    assert KEYS <= set(figures), sorted(KEYS - set(figures))
    for key in KEYS:  # the 1.5x target is not checked: it depends on the machine
        assert isinstance(figures[key], (int, float)) and figures[key] > 0, (key, figures[key])
    assert "tokens/s" in stdout  # the human table comes first
