"""One `stream-rlhf run` subprocess for the benchmarks that compare whole jobs (a helper, not a
benchmark): its output in runs/<name>.log, its summary.json and wall seconds back.

    summary, wall_s = run_job(CONFIG, "bench_x_s0", ["seed=0", ...], "column x seed 0")
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def run_job(config: Path, name: str, sets: list[str], what: str) -> tuple[dict, float]:
    """`stream-rlhf run config --set name=<name> --set ...` from the repository root: (its
    summary.json, wall seconds); exits naming `what` and the log when the run fails."""
    started = time.monotonic()
    log = REPO / "runs" / f"{name}.log"
    with log.open("w") as out:
        done = subprocess.run([sys.executable, "-m", "stream_rlhf.cli", "run", str(config),
                               *(x for s in [f"name={name}", *sets] for x in ("--set", s))],
                              cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        sys.exit(f"{what}: the run failed (exit {done.returncode}); see {log}")
    return json.loads((REPO / "runs" / name / "summary.json").read_text()), round(time.monotonic() - started, 1)
