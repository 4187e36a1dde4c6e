"""bench/vs_trl.py: without TRL it says how to set it up; with TRL's environment it runs a row."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.bench_run import REPO

TRL_PYTHON = REPO / ".venv-trl" / "bin" / "python"


def test_without_trl_it_names_the_setup_and_exits_2(tmp_path):
    result = subprocess.run([sys.executable, "bench/vs_trl.py", "--trl-python", str(tmp_path / "python")],
                            cwd=REPO, capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 2
    assert "no Python that imports trl" in result.stderr
    assert "pip install -c constraints/cpu.txt torch trl==1.16.0" in result.stderr


@pytest.mark.slow
@pytest.mark.skipif(not TRL_PYTHON.exists(), reason="TRL's environment .venv-trl is not set up; "
                    "bench/vs_trl.py's docstring has the one-line setup that makes this test run")
@pytest.mark.parametrize("row", ["0.4M_eos", "0.4M_eos_lora"])  # the whole policy, and LoRA on both sides
def test_a_row_runs_both_sides_on_the_same_samples(row):
    result = subprocess.run([sys.executable, "bench/vs_trl.py", "--rows", row, "--steps", "4", "--json"],
                            cwd=REPO, capture_output=True, text=True, timeout=900, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    figures = json.loads(result.stdout.strip().splitlines()[-1])[row]
    for side in ("ours", "trl"):
        assert len(figures[side]["reward_curve"]) == 4
        assert figures[side]["tokens_per_s"] > 0 and figures[side]["peak_mb"] > 0
    assert figures["ratio"] == pytest.approx(figures["ours"]["tokens_per_s"] / figures["trl"]["tokens_per_s"])
    assert f"{row}  (ours / TRL tokens/s = " in result.stdout
