"""Pipeline benchmark: the same PPO job under the sync and stream schedules, side by side.

Each schedule is one `stream-rlhf run configs/text_ppo.yaml` subprocess with the overrides of
WORKLOAD below, placement `separated` (prompts + rollout on core 0, every forward and trainer
stage on core 1), `timeline=true`, and a name of its own (runs/bench_pipeline_<schedule>/):

    sync      schedule=sync   overlap_depth=0   generate all, then forward all, then train
    stream0   schedule=stream overlap_depth=0   mini-batch pipelining inside an iteration
    stream1   schedule=stream overlap_depth=1   rollout of iteration i+1 overlaps training of i

Figures, per schedule, over the steady-state window: from the end of iteration SKIP-1's
training to the end of the last iteration's (the first SKIP iterations also pay for process
start-up, the warm-up of every stage and, for stream1, the filling of the pipeline):

    tokens/s       as in the HybridFlow paper: prompt + response tokens of each iteration's
                   global batch (actor_train's metrics.jsonl `tokens`) / iteration time,
                   summed over the window: sum(tokens) / sum(iteration_s).
    iteration s    mean `iteration_s` (training end to training end) over the window.
    busy           per stage: sum of its step durations (timeline/*.jsonl, clipped to the window)
                   / window. A step's duration is wall time, so stages time-sharing core 1 can
                   add up to more than 1.
    bubble ratio   over the two core groups, rollout side (prompts, rollout) and train side (every
                   forward and trainer): 1 - (busy time of each group, overlapping steps within a
                   group merged, summed) / (2 * window). 0: both core groups always working.

Workload (WORKLOAD; the model, task and warm start are those of text_ppo.yaml, so the cached
warm start is reused). What streaming can overlap is generation on core 0 with forwards and
training on core 1; the figure only means something when the two take comparable time. With the
config as it is, responses stop at <eos> after ~3.5 tokens and one iteration spends ~0.05 s
generating against ~0.6 s forwarding and training: the job is training-bound and no schedule can
hide more than ~8 % of it. So:

    rollout.stop=[] and rollout.max_new_tokens=MAX_NEW   responses of a fixed length (throughput
        benchmarks ignore EOS, as verl's do, so the token count per iteration does not drift as the
        policy changes); generation costs one decode step per token, ~linear in the length,
        while forwards and training process the whole sequence at once.
    algorithm.ppo_epochs=1                               one pass over the batch per iteration.
    rollout_batch.minibatches=4                          mini-batches of 32 prompts: stream0 can
        forward mini-batch k while mini-batch k+1 generates.

With these, per iteration on this 2-core VM: generation ~X s on core 0, forwards + training
~Y s on core 1 (figures of the sync run: the `busy` rows).

Run from the repository root:

    .venv/bin/python bench/pipeline.py            # full run (~4 minutes): the table
    .venv/bin/python bench/pipeline.py --quick    # smoke run (~2 minutes): few iterations
    .venv/bin/python bench/pipeline.py --json     # the table, then one JSON object as the last line

Results and the machine they were measured on: bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from stream_rlhf.broker import shm
from stream_rlhf.rl.dataflow import ROLLOUT_SIDE
from stream_rlhf.weights.shm_store import weights_root

CONFIG = "configs/text_ppo.yaml"
RUNS_DIR = Path("runs")
SCHEDULES = {
    "sync": ("sync", 0),
    "stream0": ("stream", 0),
    "stream1": ("stream", 1),
}
"""Column name -> (schedule, overlap_depth)."""
WORKLOAD = [
    "placement.mode=separated",
    "rollout.stop=[]",
    "rollout.max_new_tokens=56",
    "rollout_batch.prompts_per_minibatch=4",
    "rollout_batch.minibatches=8",
    "algorithm.ppo_epochs=1",
]
RUN_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class Settings:
    iterations: int
    """Iterations of each run."""
    skip: int
    """Leading iterations outside the steady-state window."""


FULL = Settings(iterations=30, skip=2)
QUICK = Settings(iterations=4, skip=2)


# ---- running ---------------------------------------------------------------------------------


def run_schedule(column: str, settings: Settings, prefix: str) -> Path:
    """One `stream-rlhf run` subprocess; returns its run folder. Its output goes to
    runs/bench_pipeline_<column>.log (shown, the tail, when it fails)."""
    schedule, depth = SCHEDULES[column]
    name = f"bench_pipeline_{column}"
    log_path = RUNS_DIR / f"{name}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    command = [
        sys.executable, "-m", "stream_rlhf.cli", "run", CONFIG,
        *(f"--set={o}" for o in [
            f"name={name}", f"schedule={schedule}", f"overlap_depth={depth}", f"iterations={settings.iterations}",
            "timeline=true", f"broker.shm_prefix={prefix}", *WORKLOAD,
        ]),
    ]
    with log_path.open("w") as log:
        code = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, timeout=RUN_TIMEOUT_S).returncode
    assert_nothing_left(prefix, name)
    if code != 0:
        tail = "\n".join(log_path.read_text().splitlines()[-30:])
        raise RuntimeError(f"{' '.join(command)}: exit code {code}; last lines of {log_path}:\n{tail}")
    return RUNS_DIR / name


def assert_nothing_left(prefix: str, name: str) -> None:
    """Remove what a run left in /dev/shm (payload segments, the weight folder), and fail: a
    leak is a bug, not a figure."""
    left = [segment for segment, _ in shm.list_segments(prefix)]
    for segment in left:
        shm.unlink(segment)
    weights = weights_root(prefix, name)
    if weights.exists():
        left.append(str(weights))
        subprocess.run(["rm", "-rf", str(weights)], check=False)
    if left:
        raise RuntimeError(f"{len(left)} shared-memory object(s) left behind by {name}, e.g. {left[0]}")


# ---- figures ---------------------------------------------------------------------------------


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def merged_length(spans: list[tuple[float, float]]) -> float:
    """Total length of the union of [start, end) spans."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(spans):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def clip(spans: list[tuple[float, float]], lo: float, hi: float) -> list[tuple[float, float]]:
    return [(max(s, lo), min(e, hi)) for s, e in spans if e > lo and s < hi]


def analyse(run_dir: Path, skip: int) -> dict:
    """Figures of one run over iterations skip..end (see the module docstring)."""
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    steps = [r for path in sorted((run_dir / "timeline").glob("*.jsonl")) for r in read_jsonl(path)]
    iterations = len(metrics)
    if iterations <= skip:
        raise RuntimeError(f"{run_dir}: {iterations} iteration(s) recorded, the window skips {skip}")
    steady = metrics[skip:]
    iteration_s = sum(r["iteration_s"] for r in steady)
    # the window: end of training of iteration skip-1 -> end of training of the last iteration
    done = {}
    for r in steps:
        if r["stage"] == "actor_train":
            done[r["iteration"]] = max(done.get(r["iteration"], 0.0), r["end"])
    lo, hi = done[skip - 1], done[iterations - 1]
    window = hi - lo
    per_stage: dict[str, list[tuple[float, float]]] = {}
    for r in steps:
        per_stage.setdefault(r["stage"], []).append((r["start"], r["end"]))
    busy = {stage: sum(e - s for s, e in clip(spans, lo, hi)) / window for stage, spans in sorted(per_stage.items())}
    groups = {"rollout": [], "train": []}
    for stage, spans in per_stage.items():
        groups["rollout" if stage in ROLLOUT_SIDE else "train"].extend(clip(spans, lo, hi))
    group_busy = {group: merged_length(spans) / window for group, spans in groups.items()}
    summary = json.loads((run_dir / "summary.json").read_text())
    return {
        "tokens_per_s": sum(r["tokens"] for r in steady) / iteration_s,
        "iteration_s": iteration_s / len(steady),
        "window_s": window,
        "window_iterations": len(steady),
        "tokens_per_iteration": sum(r["tokens"] for r in steady) / len(steady),
        "bubble_ratio": 1 - (group_busy["rollout"] + group_busy["train"]) / 2,
        "group_busy": group_busy,
        "busy": busy,
        "max_staleness": summary["max_staleness"],
        "samples_dropped": summary["samples_dropped"],
        "job_s": summary["job_s"],
    }


# ---- report ----------------------------------------------------------------------------------


def format_table(results: dict[str, dict], settings: Settings) -> str:
    columns = list(results)
    sync = results["sync"]
    rows: list[tuple[str, ...]] = [("", *columns)]

    def row(label: str, fmt: str, get) -> None:
        rows.append((label, *(format(get(results[c]), fmt) for c in columns)))

    row("tokens/s", ",.0f", lambda r: r["tokens_per_s"])
    row("  / sync", ".2f", lambda r: r["tokens_per_s"] / sync["tokens_per_s"])
    row("iteration s (mean)", ".3f", lambda r: r["iteration_s"])
    row("  / sync", ".2f", lambda r: r["iteration_s"] / sync["iteration_s"])
    row("tokens / iteration", ",.0f", lambda r: r["tokens_per_iteration"])
    row("bubble ratio", ".3f", lambda r: r["bubble_ratio"])
    row("busy, rollout side", ".3f", lambda r: r["group_busy"]["rollout"])
    row("busy, train side", ".3f", lambda r: r["group_busy"]["train"])
    stages = sorted({s for r in results.values() for s in r["busy"]}, key=lambda s: (s not in ROLLOUT_SIDE, s))
    for stage in stages:
        row(f"  {stage}", ".3f", lambda r, s=stage: r["busy"].get(s, 0.0))
    row("max staleness", "d", lambda r: r["max_staleness"])
    row("window s", ".1f", lambda r: r["window_s"])
    row("job s (whole run)", ".1f", lambda r: r["job_s"])
    lines = [f"{label:<22}" + "".join(f"{v:>11}" for v in values) for label, *values in rows]
    notes = [
        f"steady state: iterations {settings.skip}..{settings.iterations - 1} of {settings.iterations} "
        f"(the first {settings.skip} skipped: start-up, warm-up, pipeline fill)",
        "tokens/s: prompt + response tokens of the global batch / iteration time (HybridFlow)",
        "busy: step wall time / window per stage (stages sharing a core can sum past 1); bubble ratio: "
        "1 - (merged busy time of the rollout side + of the train side) / (2 * window)",
        f"workload: {CONFIG} with {' '.join(WORKLOAD)}",
    ]
    return "\n".join([*lines, "", *notes])


def progress(text: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"smoke run: {QUICK.iterations} iterations per schedule")
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last stdout line")
    args = parser.parse_args()
    settings = QUICK if args.quick else FULL
    prefix = f"bp{uuid.uuid4().hex[:8]}"
    results = {}
    for column in SCHEDULES:
        progress(f"{column}: {settings.iterations} iterations (runs/bench_pipeline_{column}.log)")
        started = time.monotonic()
        results[column] = analyse(run_schedule(column, settings, prefix), settings.skip)
        progress(f"{column}: {results[column]['tokens_per_s']:,.0f} tokens/s ({time.monotonic() - started:.0f} s)")
    print(format_table(results, settings))
    if args.json:
        sync = results["sync"]["tokens_per_s"]
        print(json.dumps({
            "sync_tokens_per_s": round(sync, 1),
            "stream0_tokens_per_s": round(results["stream0"]["tokens_per_s"], 1),
            "stream1_tokens_per_s": round(results["stream1"]["tokens_per_s"], 1),
            "stream0_over_sync": round(results["stream0"]["tokens_per_s"] / sync, 3),
            "stream1_over_sync": round(results["stream1"]["tokens_per_s"] / sync, 3),
            "bubble_ratio_sync": round(results["sync"]["bubble_ratio"], 3),
            "bubble_ratio_stream0": round(results["stream0"]["bubble_ratio"], 3),
            "bubble_ratio_stream1": round(results["stream1"]["bubble_ratio"], 3),
            "iteration_s_sync": round(results["sync"]["iteration_s"], 3),
            "iteration_s_stream0": round(results["stream0"]["iteration_s"], 3),
            "iteration_s_stream1": round(results["stream1"]["iteration_s"], 3),
        }))


if __name__ == "__main__":
    main()
