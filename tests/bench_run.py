"""Runs a benchmark script's smoke mode for the bench tests and returns its JSON figures."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def run_bench_json(script: str, tmp_path: Path, timeout_s: float, *args: str) -> tuple[dict, str]:
    """`python SCRIPT --quick --json [ARGS]` from the repository root: (its last line as JSON, its stdout)."""
    stdout, stderr = tmp_path / "stdout", tmp_path / "stderr"
    with stdout.open("w") as out, stderr.open("w") as err:  # files, not pipes: the stage processes
        try:  # inherit them and a full pipe would stall the run
            code = subprocess.run(
                [sys.executable, script, "--quick", "--json", *args], check=False, cwd=REPO, stdout=out, stderr=err,
                timeout=timeout_s,
            ).returncode
        except subprocess.TimeoutExpired:  # give timeout_s below the test's own timeout to get here
            pytest.fail(f"{script} --quick ran past {timeout_s}s; its stderr ends:\n{stderr.read_text()[-3000:]}")
    assert code == 0, stderr.read_text()[-3000:]
    text = stdout.read_text()
    return json.loads(text.strip().splitlines()[-1]), text
