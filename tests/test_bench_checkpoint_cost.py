"""bench/checkpoint_cost.py's smoke run: three runs (no checkpoints, the sync writer, the
background writer) and the figures it promises; its targets are not checked (they depend on the
machine)."""

from __future__ import annotations

import pytest

from tests.bench_run import run_bench_json

pytestmark = pytest.mark.slow


@pytest.mark.timeout(900)  # three tiny runs: ~2 minutes on a quiet 2-core machine, several times that loaded
def test_bench_checkpoint_cost_quick_json(tmp_path):
    figures, stdout = run_bench_json("bench/checkpoint_cost.py", tmp_path, timeout_s=840)
    assert set(figures) == {"off", "sync", "background"}
    for column, f in figures.items():
        assert len(f["iteration_s"]) == 8 and f["mean_s"] > 0 and f["max_over_median"] >= 1, column
    # every 2 of 8 iterations, the last included: 4 writes; without: the last only
    assert (figures["off"]["checkpoints"], figures["sync"]["checkpoints"], figures["background"]["checkpoints"]) == \
        (1, 4, 4)
    assert figures["off"]["cost"] == 0 and "background checkpoints cost" in stdout
