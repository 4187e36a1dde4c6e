"""What checkpointing costs the training loop: checkpoints written in the background against the
synchronous writer, both against the same job with no checkpoint on the way (issue 32).

One invocation runs `stream-rlhf run configs/text_grpo.yaml` three times with `bench/vs_trl.py`'s
12M settings (hidden 512, 4 layers, 12.7M parameters; 16 prompts x 4 samples per step, one
optimizer step per step, answers ending at <eos>), one after the other:

    column       checkpoint settings
    off          checkpoint.every=0: only after the last iteration (outside every measured one)
    sync         checkpoint.every=2, checkpoint.background=false: training waits for each write
    background   checkpoint.every=2 (checkpoint.background=true, the default): training waits
                 for a snapshot; a thread writes, hashes and publishes it meanwhile

Figures per column, over the iterations after the first SKIP (start-up, first shapes):

    mean s       mean of actor_train's `iteration_s` (the end of one iteration's training to the
                 end of the next's: a save after iteration i lands in iteration i + 1's)
    cost         mean s / the `off` column's mean s - 1       target for background: <= 15%
    max/median   the slowest of those iterations / their median  target for background: <= 1.6
    snapshot s, write s   mean `checkpoint snapshot` / `checkpoint write` span of the actor (trace.json)

Run from the repository root:

    .venv/bin/python bench/checkpoint_cost.py            # 3 runs of 30 iterations (~5 minutes warm)
    .venv/bin/python bench/checkpoint_cost.py --quick    # smoke run: the 0.4M model, 8 iterations
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from vs_trl import MODEL_12M, REPO, SHAPE, run_watched  # bench/, beside this script

CONFIG = "configs/text_grpo.yaml"
SKIP = 2
COST_TARGET = 0.15
SPIKE_TARGET = 1.6
COLUMNS = {
    "off": ["checkpoint.every=0"],
    "sync": ["checkpoint.every=2", "checkpoint.background=false"],
    "background": ["checkpoint.every=2", "checkpoint.background=true"],
}


def run_column(column: str, iterations: int, model: list[str], quick: bool) -> dict:
    """One run of `column`'s checkpoint settings: its iteration times and checkpoint spans."""
    name = f"bench_checkpoint_cost_{'quick_' if quick else ''}{column}"
    overrides = [f"name={name}", f"iterations={iterations}", "rollout.max_new_tokens=5", *SHAPE, *model,
                 *COLUMNS[column]]
    command = [sys.executable, "-m", "stream_rlhf.cli", "run", CONFIG, *(f"--set={o}" for o in overrides)]
    run_watched(command, REPO / "runs" / f"{name}.log", 1800)
    run_dir = REPO / "runs" / name
    seconds = [json.loads(line)["iteration_s"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    if len(seconds) <= SKIP:
        raise ValueError(f"{name}: {len(seconds)} iterations, need more than SKIP={SKIP}")
    window = seconds[SKIP:]
    return {"iteration_s": seconds, "mean_s": statistics.fmean(window),
            "max_over_median": max(window) / statistics.median(window), **_spans(run_dir / "trace.json")}


def _spans(trace: Path) -> dict:
    """Mean duration (s) of the checkpoint snapshots and writes in the run's trace (GRPO: the actor's alone)."""
    events = json.loads(trace.read_text())
    events = events["traceEvents"] if isinstance(events, dict) else events
    spans: dict[str, list[float]] = {"checkpoint snapshot": [], "checkpoint write": []}
    for event in events:
        if event.get("name") in spans:
            spans[event["name"]].append(event["dur"] / 1e6)
    return {"snapshot_s": statistics.fmean(spans["checkpoint snapshot"] or [0.0]),
            "write_s": statistics.fmean(spans["checkpoint write"] or [0.0]),
            "checkpoints": len(spans["checkpoint write"])}


def report(results: dict) -> list[str]:
    off = results["off"]["mean_s"]
    lines = [f"  {'column':12s}{'mean s':>9s}{'cost':>9s}{'max/median':>12s}{'snapshot s':>12s}{'write s':>9s}"
             f"{'saves':>7s}"]
    for column, f in results.items():
        f["cost"] = f["mean_s"] / off - 1
        lines.append(f"  {column:12s}{f['mean_s']:9.3f}{f['cost']:9.1%}{f['max_over_median']:12.2f}"
                     f"{f['snapshot_s']:12.3f}{f['write_s']:9.3f}{f['checkpoints']:7d}")
    background, sync = results["background"], results["sync"]
    cost_ok = "PASS" if background["cost"] <= COST_TARGET else "FAIL"
    spike_ok = "PASS" if background["max_over_median"] <= SPIKE_TARGET else "FAIL"
    lines += [f"background checkpoints cost {background['cost']:.1%} of the mean iteration (target <= "
              f"{COST_TARGET:.0%}: {cost_ok}); the sync writer's {sync['cost']:.1%} "
              f"(mean iteration {sync['mean_s'] / off:.2f}x of no checkpoints, background "
              f"{background['mean_s'] / off:.2f}x)",
              f"slowest iteration after the second / median: background {background['max_over_median']:.2f} "
              f"(target <= {SPIKE_TARGET}: {spike_ok}), sync {sync['max_over_median']:.2f}, "
              f"off {results['off']['max_over_median']:.2f}"]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=30)
    parser.add_argument("--quick", action="store_true", help="smoke run: the 0.4M model, 8 iterations")
    parser.add_argument("--json", action="store_true", help="last line: every figure as JSON")
    args = parser.parse_args()
    iterations, model = (8, []) if args.quick else (args.iterations, MODEL_12M)
    load = os.getloadavg()[0]
    print(f"checkpoint cost, text_grpo {'0.4M' if args.quick else '12M'}, {iterations} iterations, "
          f"{os.cpu_count()} CPUs, load average {load:.2f}, {time.strftime('%Y-%m-%d %H:%M')}", flush=True)
    results = {}
    for column in COLUMNS:
        print(f"{column}: {iterations} iterations ...", file=sys.stderr, flush=True)
        results[column] = run_column(column, iterations, model, args.quick)
    print("\n".join(report(results)), flush=True)
    if args.json:
        print(json.dumps(results))


if __name__ == "__main__":
    main()
