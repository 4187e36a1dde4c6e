"""The decode-modes benchmark's smoke run works end to end: every row has its eager and static
figures (the script itself fails if a mode's tokens differ from eager's)."""

from __future__ import annotations

import pytest

from tests.bench_run import run_bench_json

pytestmark = pytest.mark.slow


def test_bench_decode_quick_json(tmp_path):
    figures, stdout = run_bench_json("bench/decode.py", tmp_path, timeout_s=280)
    for row in ("0.4M_plain", "0.4M_medusa", "12M_plain", "12M_medusa"):
        assert figures[f"{row}_eager"] > 0 and figures[f"{row}_static"] > 0
        assert figures[f"{row}_static_ratio"] == pytest.approx(figures[f"{row}_static"] / figures[f"{row}_eager"],
                                                               abs=2e-3)
    assert "tokens/s (ratio against eager)" in stdout  # the human table comes first
