"""The Medusa benchmark's smoke run works end to end and prints the keys it promises."""

from __future__ import annotations

import pytest

from tests.bench_run import run_bench_json

pytestmark = pytest.mark.slow

KEYS = {"plain_tokens_per_s", "stale_tokens_per_s", "companion_tokens_per_s", "stale_accept_len",
        "companion_accept_len", "speedup", "speedup_ceiling"}


def test_bench_medusa_quick_json(tmp_path):
    figures, stdout = run_bench_json("bench/medusa.py", tmp_path, timeout_s=600)
    assert KEYS <= set(figures), sorted(KEYS - set(figures))
    for key in ("plain_tokens_per_s", "stale_tokens_per_s", "companion_tokens_per_s"):
        assert figures[key] > 0, (key, figures[key])
    heads = figures["heads"]
    for key in ("stale_accept_len", "companion_accept_len"):  # tokens per verification step and row
        assert 1.0 <= figures[key] <= heads + 1, (key, figures[key])
    # the ceiling is (heads + 1) / (time of a forward over heads + 1 positions / time over one): two
    # timings, so on a loaded machine it may fall on either side of 1; only its form is checked here
    assert 0 < figures["speedup_ceiling"] < float("inf"), figures["speedup_ceiling"]
    assert "accept len" in stdout  # the human table comes first
