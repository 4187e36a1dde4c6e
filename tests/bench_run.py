"""Runs a benchmark script's smoke mode for the bench tests and returns its JSON figures."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_bench_json(script: str, tmp_path: Path, timeout_s: float) -> tuple[dict, str]:
    """`python SCRIPT --quick --json` from the repository root: (its last line as JSON, its stdout)."""
    stdout, stderr = tmp_path / "stdout", tmp_path / "stderr"
    with stdout.open("w") as out, stderr.open("w") as err:  # files, not pipes: the stage processes
        code = subprocess.run(  # inherit them and a full pipe would stall the run
            [sys.executable, script, "--quick", "--json"], check=False, cwd=REPO, stdout=out, stderr=err,
            timeout=timeout_s,
        ).returncode
    assert code == 0, stderr.read_text()[-3000:]
    text = stdout.read_text()
    return json.loads(text.strip().splitlines()[-1]), text
