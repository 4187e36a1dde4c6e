"""The train-step benchmark's smoke run works end to end: both paths give the same loss (the
script exits 1 otherwise), and the gathered path dispatches fewer operations and builds a smaller
autograd graph than the per-sample path, for the actor and the critic."""

from __future__ import annotations

import pytest

from tests.bench_run import run_bench_json

pytestmark = pytest.mark.slow


def test_bench_train_step_quick_json(tmp_path):
    figures, stdout = run_bench_json("bench/train_step.py", tmp_path, timeout_s=120)
    assert figures["device"] == "cpu" and figures["samples"] == 32
    for stage in ("actor", "critic"):
        per_sequence, gathered = figures[stage]["per_sequence"], figures[stage]["gathered"]
        assert gathered["ops"] < per_sequence["ops"] and gathered["nodes"] < per_sequence["nodes"]
        assert gathered["ms"] > 0 and per_sequence["ms"] > 0
        assert figures[stage]["ops_ratio"] == round(gathered["ops"] / per_sequence["ops"], 3)
    assert "ops/step" in stdout  # the human table comes first
