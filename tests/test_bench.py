"""The broker benchmark's smoke run works end to end and prints the keys it promises."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.bench_run import REPO

pytestmark = pytest.mark.slow

KEYS = {
    "handles_per_s", "handles_per_s_4c", "raw_msgs_per_s", "p50_hop_us", "p99_hop_us",
    "shm_gbps", "tcp_gbps", "memcpy_gbps",
}


def test_bench_broker_quick_json():
    result = subprocess.run(
        [sys.executable, "bench/broker.py", "--quick", "--json"], cwd=REPO, capture_output=True, text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    assert set(figures) == KEYS
    assert all(value > 0 for value in figures.values()), figures
    assert "handles/s, 1 consumer" in result.stdout  # the human table comes first
