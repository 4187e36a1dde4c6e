"""`stream-rlhf run` subprocesses for the benchmarks that compare whole jobs (a helper, not a
benchmark): one run's output in runs/<name>.log, its summary.json and wall seconds back; every
column of a benchmark for every seed, with a progress line each.

    summary, wall_s = run_job(CONFIG, "bench_x_s0", ["seed=0", ...], "column x seed 0")
    results = run_columns(["base", "x"], [0, 1], lambda column, seed: {...})  # column -> one dict a seed
    print_table(figures, ["base", "x"], [("eval after", "after", "{:.3f}"), ...])
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
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


def run_column(config: Path, bench: str, column: str, seed: int, iterations: int, quick: bool, eval_prompts: int,
               sets: list[str]) -> tuple[dict, float, str]:
    """One column's run for one seed, runs/bench_<bench>_<column>_s<seed>[_quick] (`quick`: a 40-step
    warm start of its own, seconds): its summary, wall seconds and run name."""
    name = f"bench_{bench}_{column}_s{seed}" + ("_quick" if quick else "")
    sets = [f"seed={seed}", f"iterations={iterations}", f"broker.shm_prefix=b_{bench}_{column}_{seed}",
            f"task.eval_prompts={eval_prompts}", *sets, *(["model.warm_start.steps=40"] if quick else [])]
    summary, wall_s = run_job(config, name, sets, f"{column} seed {seed}")
    return summary, wall_s, name


def run_columns(columns: list[str], seeds: list[int], run: Callable[[str, int], dict]) -> dict[str, list[dict]]:
    """`run(column, seed)` for every seed, each column in turn, with a line on stderr before and
    after each (the eval reward it reached, from the dict's `before`, `after` and `wall_s`)."""
    results: dict[str, list[dict]] = {column: [] for column in columns}
    for seed in seeds:
        for column in columns:
            print(f"[bench] {column} seed {seed}: running", file=sys.stderr, flush=True)
            results[column].append(run(column, seed))
            last = results[column][-1]
            print(f"[bench] {column} seed {seed}: eval reward {last['before']:.3f} -> {last['after']:.3f} "
                  f"({last['wall_s']} s)", file=sys.stderr, flush=True)
    return results


def mean(values: list[float]) -> float:
    return round(sum(values) / len(values), 4)


def print_table(figures: dict[str, dict], columns: list[str], rows: list[tuple[str, str, str]]) -> None:
    """The columns side by side, one line per (label, key of each column's figures, format)."""
    print(f"{'':18}" + "".join(f"{c:>12}" for c in columns))
    for label, key, fmt in rows:
        print(f"{label:18}" + "".join(f"{fmt.format(figures[c][key]):>12}" for c in columns))


def print_footer(figures: dict[str, dict], baseline: str, iterations: int, seeds: list[int], eval_prompts: int,
                 as_json: bool) -> None:
    """What the figures are of, and with `as_json` every figure as one JSON line."""
    print(f"\nconfigs/text_grpo.yaml, {iterations} iterations, seeds {seeds}, {eval_prompts} eval prompts; "
          "means over the seeds")
    if as_json:
        print(json.dumps({"baseline": baseline, "iterations": iterations, "seeds": seeds, "columns": figures}))
