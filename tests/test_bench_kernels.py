"""The kernels benchmark's smoke run works end to end and prints the keys it promises."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]

KEYS = {"device", "peak_mem_ratio", "speedup", "peak_mem_ratio_logits", "speedup_logits", "rows", "skipped"}


def test_bench_kernels_quick_json(tmp_path):
    stdout, stderr = tmp_path / "stdout", tmp_path / "stderr"
    with stdout.open("w") as out, stderr.open("w") as err:
        argv = [sys.executable, "bench/kernels.py", "--quick", "--json"]
        code = subprocess.run(argv, check=False, cwd=REPO, stdout=out, stderr=err, timeout=300).returncode
    assert code == 0, stderr.read_text()[-3000:]
    figures = json.loads(stdout.read_text().strip().splitlines()[-1])
    assert KEYS <= set(figures), sorted(KEYS - set(figures))
    assert figures["peak_mem_ratio"] >= 0 and figures["speedup"] > 0  # GPU targets are not checked here
    assert {row["form"] for row in figures["rows"]} == {"logits", "hidden"}
    assert all(row["agree"] for row in figures["rows"])
    assert "mem ratio" in stdout.read_text()  # the human table comes first
