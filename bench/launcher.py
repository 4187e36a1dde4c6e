"""Launcher benchmark: the same PPO job under `launcher: local` and `launcher: ray`, side by side.

    python bench/launcher.py [--iterations N] [--quick] [--json]

Each column is one `stream-rlhf run configs/text_ppo.yaml` subprocess (runs/bench_launcher_<column>/)
with these overrides, so only the launcher differs:

    iterations=N (default 12; --quick 4)    model.warm_start.steps=1 (a cached warm start of its own:
    the timing does not depend on the weights)    placement.mode=separated
    ray: launcher=ray, ray.num_cpus=2: a Ray instance of its own on this machine, started and shut
         down by the run (so its start-up is counted), every process an actor in one placement group

Figures, from each run's summary.json and metrics.jsonl:

    start-up s     job_s - sum(iteration_s): the launcher's own time, from handing it the plan to
                   the job's end, less the iterations (starting the broker and every rank, their
                   set-up before the first iteration, the drain and stop after the last); the
                   driver's warm start and evaluations are outside job_s.
    iteration s    summary.json's iteration_s: the mean over every iteration but the first (which
                   also pays for the stages' start-up).
    tokens/s       summary.json's tokens_per_s, over the same iterations.

The ratios are ray / local (the baseline): > 1 means Ray is slower. Both pin each rank to the
plan's cores (Ray on an instance of this machine's own); under Ray the ranks lend no idle cores,
so the per-iteration figure includes that difference as well as Ray's own.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "configs" / "text_ppo.yaml"
COLUMNS = {"local": ["launcher=local"], "ray": ["launcher=ray", "ray.num_cpus=2"]}


def run(column: str, iterations: int) -> dict[str, float]:
    name = f"bench_launcher_{column}"
    sets = [f"name={name}", f"iterations={iterations}", "model.warm_start.steps=1", "placement.mode=separated",
            *COLUMNS[column]]
    command = [sys.executable, "-m", "stream_rlhf.cli", "run", str(CONFIG), *(x for s in sets for x in ("--set", s))]
    print(f"[{column}] {' '.join(command[3:])}", file=sys.stderr, flush=True)
    started = time.monotonic()
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"[{column}] run failed (exit {result.returncode}):\n{result.stderr[-3000:]}")
    run_dir = ROOT / "runs" / name
    summary = json.loads((run_dir / "summary.json").read_text())
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    iterations_s = sum(r["iteration_s"] for r in records)
    print(f"[{column}] done in {time.monotonic() - started:.0f}s", file=sys.stderr, flush=True)
    return {"load_avg_1min": round(os.getloadavg()[0], 2),  # others' work on the machine shows in every figure
            "startup_s": round(summary["job_s"] - iterations_s, 2), "iteration_s": summary["iteration_s"],
            "tokens_per_s": summary["tokens_per_s"], "job_s": summary["job_s"],
            "samples_trained": summary["samples_trained"], "samples_generated": summary["samples_generated"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iterations", type=int, default=12)
    parser.add_argument("--quick", action="store_true", help="4 iterations")
    parser.add_argument("--json", action="store_true", help="also print one JSON object as the last line")
    args = parser.parse_args()
    iterations = 4 if args.quick else args.iterations
    if iterations < 2:
        sys.exit(f"--iterations {iterations}: needs >= 2 (the first iteration is left out of iteration s)")
    results = {column: run(column, iterations) for column in COLUMNS}
    local, ray = results["local"], results["ray"]
    ratios = {key: round(ray[key] / local[key], 3) for key in ("startup_s", "iteration_s")}
    print(f"{'':<14}{'local':>10}{'ray':>10}{'ray/local':>11}")
    for key, label in (("startup_s", "start-up s"), ("iteration_s", "iteration s"), ("tokens_per_s", "tokens/s"),
                       ("job_s", "job s"), ("load_avg_1min", "load (1 min)")):
        ratio = f"{ray[key] / local[key]:.3f}" if local[key] else "-"
        print(f"{label:<14}{local[key]:>10}{ray[key]:>10}{ratio:>11}")
    print(f"samples trained/generated: local {local['samples_trained']}/{local['samples_generated']}, "
          f"ray {ray['samples_trained']}/{ray['samples_generated']}")
    if args.json:
        print(json.dumps({"baseline": "local", "iterations": iterations, "results": results, "ratio": ratios}))


if __name__ == "__main__":
    main()
