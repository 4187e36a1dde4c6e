"""The pipeline benchmark's smoke run works end to end and prints the keys it promises, and the
planner's validation (bench/planner.py) reads the runs it leaves."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.bench_run import REPO, run_bench_json

pytestmark = pytest.mark.slow


KEYS = {
    "sync_tokens_per_s", "stream0_tokens_per_s", "stream1_tokens_per_s", "stream1_over_sync",
    "bubble_ratio_sync", "bubble_ratio_stream1", "auto1_tokens_per_s", "auto1_over_sync", "auto1_over_stream1",
}


@pytest.mark.timeout(900)  # ~100 s on a quiet 2-core machine, several times that on a loaded one
def test_bench_pipeline_quick_json(tmp_path):
    figures, stdout = run_bench_json("bench/pipeline.py", tmp_path, timeout_s=840)
    assert KEYS <= set(figures), sorted(KEYS - set(figures))
    for key in KEYS:  # the 1.5x target is not checked: it depends on the machine
        assert isinstance(figures[key], (int, float)) and figures[key] > 0, (key, figures[key])
    assert "tokens/s" in stdout  # the human table comes first
    # bench/planner.py on the three runs it left: every (calibration, target) pair predicted
    runs = [str(REPO / "runs" / f"bench_pipeline_quick_{mode}") for mode in ("sync", "stream0", "stream1")]
    result = subprocess.run([sys.executable, "bench/planner.py", *runs, "--json"], cwd=REPO, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    table = json.loads(result.stdout.strip().splitlines()[-1])["table"]
    schedules = {"sync", "stream k=0", "stream k=1"}
    assert set(table) == schedules and all(set(row) == schedules for row in table.values())
    assert all(cell["predicted_s"] > 0 and cell["measured_s"] > 0 for row in table.values() for cell in row.values())
