"""The weight-sync benchmark's smoke run works end to end and prints the keys it promises."""

from __future__ import annotations

import pytest

from tests.bench_run import run_bench_json

pytestmark = pytest.mark.slow

TRANSPORTS = ("disk_reload", "shm", "gloo", "cuda_ipc")
KEYS = {"model", "params", "bytes", "disk_reload_load_s"} | {
    f"{t}_{unit}" for t in TRANSPORTS for unit in ("s", "gbps")}


def test_bench_weight_sync_quick_json(tmp_path):
    figures, stdout = run_bench_json("bench/weight_sync.py", tmp_path, timeout_s=300)
    assert KEYS <= set(figures), sorted(KEYS - set(figures))
    assert figures["model"] == "tiny" and figures["bytes"] == 4 * figures["params"] > 0  # fp32
    for transport in ("disk_reload", "shm", "gloo"):  # cuda_ipc: null without a GPU; speed: bench/RESULTS.md
        assert figures[f"{transport}_s"] > 0 and figures[f"{transport}_gbps"] > 0, transport
    assert "disk_reload" in stdout and "warm page cache" in stdout  # the human table comes first
