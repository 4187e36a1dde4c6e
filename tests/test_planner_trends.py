"""bench/planner_trends.py: the seeds' published trends on paper keep the directions bench/RESULTS.md
records (the figures themselves follow from the H100 preset and the workload there)."""

from __future__ import annotations

import sys

from tests.bench_run import REPO

sys.path.insert(0, str(REPO / "bench"))
import planner_trends  # noqa: E402 - bench/ scripts import each other by file name


def test_hybridflow_colocates_on_few_gpus_and_splits_on_many():
    best = {row["gpus"]: row["best"] for row in planner_trends.hybridflow()}
    assert best == {8: "colocate", 16: "split", 32: "split", 64: "split", 128: "split"}


def test_seed004_pipelined_offload_beats_full_offload_where_conventional_does_not_fit():
    seed = planner_trends.seed004()
    conventional, full, pipelined = seed["conventional"], seed["full offload"], seed["pipelined offload"]
    assert not conventional["fits"] and full["fits"] and pipelined["fits"]
    assert pipelined["iteration_s"] < full["iteration_s"]
    assert pipelined["peak_gb"] > full["peak_gb"]  # two members' states at once


def test_realhf_sequential_is_not_beaten_here():
    real = planner_trends.realhf()
    overlapped = [f["iteration_s"] for name, f in real.items() if isinstance(f, dict) and name != "sequential"]
    assert min(overlapped) > real["sequential"]["iteration_s"]
