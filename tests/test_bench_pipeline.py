"""The pipeline benchmark's smoke run works end to end and prints the keys it promises."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]

KEYS = {
    "sync_tokens_per_s", "stream0_tokens_per_s", "stream1_tokens_per_s", "stream1_over_sync",
    "bubble_ratio_sync", "bubble_ratio_stream1",
}


def test_bench_pipeline_quick_json(tmp_path):
    stdout, stderr = tmp_path / "stdout", tmp_path / "stderr"
    with stdout.open("w") as out, stderr.open("w") as err:  # files, not pipes: the stage processes
        code = subprocess.run(  # inherit them and a full pipe would stall the run
            [sys.executable, "bench/pipeline.py", "--quick", "--json"], check=False, cwd=REPO, stdout=out, stderr=err, timeout=300
        ).returncode
    assert code == 0, stderr.read_text()[-3000:]
    figures = json.loads(stdout.read_text().strip().splitlines()[-1])
    assert KEYS <= set(figures), sorted(KEYS - set(figures))
    for key in KEYS:  # the 1.5x target is not checked: it depends on the machine
        assert isinstance(figures[key], (int, float)) and figures[key] > 0, (key, figures[key])
    assert "tokens/s" in stdout.read_text()  # the human table comes first
