"""The vision benchmark's smoke run works end to end and prints the keys it promises."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
KEYS = {"encoder_calls_prefetch", "encoder_calls_no_prefetch", "iter_s_prefetch", "iter_s_no_prefetch", "speedup"}


def test_bench_vision_quick_json(tmp_path):
    stdout, stderr = tmp_path / "stdout", tmp_path / "stderr"
    with stdout.open("w") as out, stderr.open("w") as err:  # files, not pipes: the stage processes
        code = subprocess.run(  # inherit them and a full pipe would stall the run
            [sys.executable, "bench/vision.py", "--quick", "--json"], check=False, cwd=REPO, stdout=out, stderr=err,
            timeout=600,
        ).returncode
    assert code == 0, stderr.read_text()[-3000:]
    figures = json.loads(stdout.read_text().strip().splitlines()[-1])
    assert KEYS <= set(figures), sorted(KEYS - set(figures))
    # every stage that needs features encodes for itself without prefetch: six times the images
    assert figures["encoder_calls_no_prefetch"] == 6 * figures["encoder_calls_prefetch"] > 0
    assert figures["iter_s_prefetch"] > 0 and figures["iter_s_no_prefetch"] > 0  # speed: bench/RESULTS.md
    assert "encoder calls" in stdout.read_text()  # the human table comes first
