"""Pipeline benchmark: the same PPO job under the sync and stream schedules, side by side.

Each schedule is one `stream-rlhf run configs/text_ppo.yaml` subprocess with the WORKLOAD
overrides below, its placement pinned (PLACEMENT: `separated`, prompts + rollout on core 0, every
forward and trainer stage on core 1, no device groups: the config's `placement: auto` would choose
per workload, and the benchmark's meaning must not drift with it), the run's trace on (the
default) and a name of its own (runs/bench_pipeline_<column>/):

    sync      schedule=sync   overlap_depth=0   generate all, then forward all, then train
    stream0   schedule=stream overlap_depth=0   mini-batches flow on as they are generated
    stream1   schedule=stream overlap_depth=1   and rollout of iteration i+1 overlaps training of i
    auto1     stream1 with the config's shipped `placement: auto` (cores still pinned): what a user
              of the config gets; its run's summary.json says what auto chose
              (`placement.auto.placement`), shown under the table

--placements adds a stream1 column for each static `placement.with_rollout` the planner's search
tries (`planner/search.py` `with_rollout_candidates`: none, critic_train, the critic's two
stages, the forwards, the forwards and critic_train), and prints auto1's tokens/s against the best
of them (the issue's check: >= 95%).

Figures, per schedule, over the steady-state window: from the end of iteration SKIP-1's
training to the end of the last iteration's. The first SKIP = 2 iterations are left out: the
first is timed from the trainer's start-up, while rollout may already have run (and in stream1
it is the pipeline fill), and the second still runs into stages warming up. The window, busy
fractions and bubble ratio come from the run's trace.json through the product's own
`stream_rlhf.telemetry.trace_figures` (its docstring defines them), the figures the run's
summary.json reports too.

    tokens/s       as in the HybridFlow paper: prompt + response tokens of the iteration's global
                   batch (actor_train's metrics.jsonl `tokens`) / iteration time; over the window,
                   sum(tokens) / sum(iteration_s).
    iteration s    mean `iteration_s` (end of training to end of training) over the window.
    busy           per stage: the sum of its step durations (clipped to the window) / window.
                   Durations are wall time, so stages that time-share core 1 can add up to more
                   than 1.
    bubble ratio   over the two core groups, rollout side (prompts, rollout) and train side (every
                   forward and trainer): 1 - (busy time of each group, overlapping steps within a
                   group merged, summed) / (2 * window). 0: both groups always have a step running.
    hidden s       time hidden by overlap: the sum of the stages' busy time minus the length of the
                   union of every step, over the window.
    CPU, cores     mean cores used over the window by the run's processes, by everything else on
                   the machine, and stolen by the hypervisor (/proc/stat, /proc/<pid>/stat sampled
                   every 0.5 s): other work on a 2-core machine shows up in every figure.

Workload. Streaming overlaps generation (core 0) with forwards and training (core 1), so the
figure means something only when the two take comparable time per iteration. With text_ppo.yaml
as it is, responses stop at <eos> after ~3.5 tokens: an iteration spends ~0.05 s generating and
~0.6 s forwarding and training, and no schedule can hide more than a few per cent of that. On this
CPU the tiny model's decoding is bound by per-step overhead (~0.7 ms a step for 4 prompts), while
forwards and training cost per token, so generation catches up with long responses on small
batches:

    rollout.stop=[], rollout.max_new_tokens=48   fixed-length responses (throughput benchmarks
        ignore EOS, as verl's do, so the tokens per iteration do not drift as the policy
        changes); 48 decode steps per mini-batch, prompt + response ~54 tokens (the model has 64
        positions).
    rollout_batch: 8 mini-batches of 4 prompts, 1 sample each   8 x 48 decode steps per iteration,
        0.3-0.4 s on core 0; 32 sequences to forward (x3) and train on, 0.3-0.4 s on core 1 (sync
        runs on the machine of bench/RESULTS.md). Generation is kept slightly lighter: under
        streaming it shares core 0 with the broker and the launcher, which no placement pins and
        which the OS moves to the less loaded core; and with overlap_depth 1 actor_train adds a
        forward pass (it recomputes the proximal log-probs when rollout ran ahead).
    algorithm: gae (critic stages), ppo_epochs=1, train_minibatches=2   one pass over the batch,
        two optimizer steps per trainer.
    model.warm_start.steps=1   with fixed-length responses the timing does not depend on the
        weights; this warm start is its own cache entry (runs/.cache), built in about a second on a
        fresh machine instead of the config's 400 SFT steps (one to two minutes on 2 cores).

Every knob that sets the timing is pinned here (auto1's placement apart), so a change of the
config's defaults does not change the benchmark; the model architecture and the task are the
config's.

Run from the repository root:

    .venv/bin/python bench/pipeline.py            # full run (~4 minutes): the table
    .venv/bin/python bench/pipeline.py --placements   # and 5 static placements (~9 minutes)
    .venv/bin/python bench/pipeline.py --quick    # smoke run (~2 minutes): 4 iterations each
    .venv/bin/python bench/pipeline.py --json     # the table, then one JSON object as the last line
    .venv/bin/python bench/pipeline.py --trace-overhead   # what tracing costs (~5 minutes; see below)

--trace-overhead runs the sync schedule TRACE_PAIRS times with `trace=false` and with the trace
on, alternating (so that drifting load on the machine touches both alike), and compares the mean
`iteration_s` of the steady-state iterations (metrics.jsonl: a run without a trace has no window
from the trace). Sync, because there every step's cost shows in the iteration time; a stream
schedule could hide it behind overlap.

Each run's output goes to runs/bench_pipeline_<column>.log (--quick: bench_pipeline_quick_<column>).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from process_tree import process_table, tree  # bench/, beside this script

from stream_rlhf.broker.payload import shm
from stream_rlhf.driver.dataflow import ROLLOUT_SIDE
from stream_rlhf.planner.search import with_rollout_candidates
from stream_rlhf.telemetry.trace_figures import trace_figures
from stream_rlhf.weights.shm_store import SHM_ROOT

REPO = Path(__file__).resolve().parents[1]
CONFIG = "configs/text_ppo.yaml"
RUNS_DIR = REPO / "runs"
SCHEDULES = {"sync": ("sync", 0), "stream0": ("stream", 0), "stream1": ("stream", 1), "auto1": ("stream", 1)}
"""Column -> (schedule, overlap_depth)."""
STATIC = with_rollout_candidates(["ref_forward", "reward_forward", "critic_forward", "actor_train", "critic_train"])
"""--placements: the with_rollout the search tries for this job's train-side stages (stream1: no
actor_forward)."""
CORES = ["placement.rollout_cores=[0]", "placement.train_cores=[1]"]
PLACEMENT = ["placement.mode=separated", "placement.with_rollout=[]", "placement.device_groups={}"]
"""The schedule columns' placement, every key auto would choose pinned."""
WORKLOAD = [
    "rollout.stop=[]",
    "rollout.max_new_tokens=48",
    "rollout_batch.prompts_per_minibatch=4",
    "rollout_batch.minibatches=8",
    "rollout_batch.samples_per_prompt=1",
    "algorithm.advantage=gae",
    "algorithm.ppo_epochs=1",
    "algorithm.train_minibatches=2",
    "model.warm_start.steps=1",
]
TARGET = 1.5
"""stream1 / sync tokens/s expected on a 2-core CPU machine."""
AUTO_TARGET = 0.95
"""--placements: auto1 / the best static placement's stream1, tokens/s, expected at least."""
RUN_TIMEOUT_S = 600.0
TRACE_PAIRS = 2
"""--trace-overhead: runs with the trace off and on, each."""


@dataclass(frozen=True)
class Settings:
    name: str
    """Run names are bench_pipeline_<name><column>."""
    iterations: int
    """Iterations of each run."""
    skip: int = 2
    """Leading iterations outside the steady-state window (>= 1: the window starts at the end of
    iteration skip-1)."""

    def __post_init__(self) -> None:
        if not 1 <= self.skip < self.iterations:
            raise ValueError(f"skip={self.skip}: must be in [1, iterations={self.iterations})")


FULL = Settings(name="", iterations=45)
QUICK = Settings(name="quick_", iterations=4)


# ---- running ---------------------------------------------------------------------------------


def run_schedule(column: str, settings: Settings, prefix: str, trace: bool = True, suffix: str = "") -> Path:
    """One `stream-rlhf run` subprocess (`trace`: with its trace; `suffix`: added to the run's
    name); returns its run folder. Fails when the run does, or when it left anything in /dev/shm."""
    schedule, depth = SCHEDULES[column.split("_")[0]]
    name = f"bench_pipeline_{settings.name}{column}{suffix}"
    log_path = RUNS_DIR / f"{name}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    overrides = [
        f"name={name}", f"schedule={schedule}", f"overlap_depth={depth}", f"iterations={settings.iterations}",
        f"trace={str(trace).lower()}", f"broker.shm_prefix={prefix}", *CORES, *WORKLOAD, *placement_of(column),
    ]
    command = [sys.executable, "-m", "stream_rlhf.cli", "run", CONFIG, *(f"--set={o}" for o in overrides)]
    before = shm_entries()
    samplers: list[CpuSampler] = []

    def sample(pid: int) -> Callable[[], None]:
        samplers.append(CpuSampler(pid))
        return samplers[0].stop

    run_logged(command, log_path, watch=sample)
    sampler = samplers[0]
    assert_nothing_left(before, prefix, name)
    (RUNS_DIR / name / "cpu_samples.json").write_text(json.dumps(sampler.samples))
    return RUNS_DIR / name


def placement_of(column: str) -> list[str]:
    """The placement `--set`s of a column: none for auto1 (the config's `placement: auto`),
    PLACEMENT's with the column's with_rollout for a --placements column (stream1_<i>: STATIC[i]),
    PLACEMENT for the others."""
    if column == "auto1":
        return []
    if column.startswith("stream1_"):
        moved = STATIC[int(column.split("_")[1])]
        return [*PLACEMENT[:1], f"placement.with_rollout=[{', '.join(moved)}]", *PLACEMENT[2:]]
    return PLACEMENT


def run_logged(command: list[str], log_path: Path, env: dict[str, str] | None = None,
               watch: Callable[[int], Callable[[], None]] | None = None, timeout_s: float = RUN_TIMEOUT_S) -> None:
    """Run `command` from the repository with its output in `log_path` (and `env` added to this
    environment); raise with the log's end when it fails or outlives `timeout_s`. `watch(pid)`
    starts something for the run's lifetime and returns what stops it."""
    with log_path.open("w") as log:
        process = subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                   env={**os.environ, **(env or {})})
        stop = watch(process.pid) if watch is not None else None
        try:
            code = process.wait(timeout_s)
        finally:
            if stop is not None:
                stop()
            if process.poll() is None:
                process.terminate()  # the launcher drains and stops its stages on SIGTERM
                process.wait(60)
    if code != 0:
        tail = "\n".join(log_path.read_text().splitlines()[-30:])
        raise RuntimeError(f"{' '.join(command)}: exit code {code}; the end of {log_path}:\n{tail}")


class CpuSampler:
    """Every PERIOD_S, in a thread: wall time, the machine's busy and steal CPU seconds
    (/proc/stat) and the CPU seconds of this process and of the run's process tree (/proc/<pid>),
    so that `machine_load` can tell what else ran during the steady-state window."""

    PERIOD_S = 0.5

    def __init__(self, root_pid: int):
        self.root_pid = root_pid
        self.samples: list[tuple[float, float, float, float]] = []
        self.tick = os.sysconf("SC_CLK_TCK")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.PERIOD_S):
            self.samples.append(self.sample())

    def sample(self) -> tuple[float, float, float, float]:
        with open("/proc/stat") as f:
            user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, f.readline().split()[1:9])
        busy = (user + nice + system + irq + softirq) / self.tick
        own = resource.getrusage(resource.RUSAGE_SELF)
        return time.time(), busy, steal / self.tick, own.ru_utime + own.ru_stime + self._tree_cpu_s()

    def _tree_cpu_s(self) -> float:
        """utime + stime of root_pid and its descendants (and of their reaped children)."""
        table = process_table()
        return sum(sum(int(x) for x in table[pid][11:15]) for pid in tree(self.root_pid, table)) / self.tick


def machine_load(samples: list[list[float]], lo: float, hi: float) -> dict[str, float]:
    """Mean cores used, from the first sample at or after `lo` to the last at or before `hi`: by
    the run (and this process), by everything else on the machine, and stolen by the hypervisor."""
    inside = [s for s in samples if lo <= s[0] <= hi]
    if len(inside) < 2:
        return {}
    (t0, busy0, steal0, ours0), (t1, busy1, steal1, ours1) = inside[0], inside[-1]
    wall = t1 - t0
    return {
        "our_cores": (ours1 - ours0) / wall,
        "other_cores": max(0.0, (busy1 - busy0) - (ours1 - ours0)) / wall,
        "steal_cores": (steal1 - steal0) / wall,
    }


def shm_entries() -> set[str]:
    return set(os.listdir(SHM_ROOT)) if SHM_ROOT.is_dir() else set()


def assert_nothing_left(before: set[str], prefix: str, name: str) -> None:
    """Fail if the run left anything of its own in /dev/shm (payload segments, weight folder),
    after removing it: a leak is a bug, not a figure. Other new entries may belong to other
    processes of the machine: reported, not removed."""
    new = sorted(shm_entries() - before)
    ours = [entry for entry in new if entry.startswith(prefix)]
    for entry in ours:
        path = SHM_ROOT / entry
        shutil.rmtree(path) if path.is_dir() else shm.unlink("/" + entry)
    if ours:
        raise RuntimeError(f"{name} left {len(ours)} entr(ies) in {SHM_ROOT}: {ours[:5]}")
    if new:
        progress(f"note: new in {SHM_ROOT} during {name}, not of this run's prefix {prefix}: {new[:5]}")


# ---- figures ---------------------------------------------------------------------------------


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def analyse(run_dir: Path, skip: int) -> dict:
    """The figures of one run over iterations skip..last (see the module docstring)."""
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    iterations = len(metrics)
    if iterations <= skip:
        raise RuntimeError(f"{run_dir}: {iterations} iteration(s) in metrics.jsonl, the window skips {skip}")
    steady = metrics[skip:]
    iteration_s = sum(r["iteration_s"] for r in steady)
    tokens = sum(r["tokens"] for r in steady)
    events = json.loads((run_dir / "trace.json").read_text())["traceEvents"]
    trace = trace_figures(events, ROLLOUT_SIDE, skip)
    if trace is None:
        raise RuntimeError(f"{run_dir}/trace.json: no actor_train step of iteration {skip - 1} or later")
    summary = json.loads((run_dir / "summary.json").read_text())
    samples_path = run_dir / "cpu_samples.json"
    load = machine_load(json.loads(samples_path.read_text()), trace.lo, trace.hi) if samples_path.is_file() else {}
    return {
        **load,
        "tokens_per_s": tokens / iteration_s,
        "iteration_s": iteration_s / len(steady),
        "tokens_per_iteration": tokens / len(steady),
        "window_s": trace.window_s,
        "bubble_ratio": trace.bubble_ratio,
        "overlap_hidden_s": trace.overlap_hidden_s,
        "group_busy": trace.group_busy,
        "busy": trace.busy,
        "max_staleness": summary["max_staleness"],
        "samples_dropped": summary["samples_dropped"],
        "job_s": summary["job_s"],
        "with_rollout": summary["placement"]["running"]["with_rollout"],
        "auto": summary["placement"]["auto"],
    }


def mean_iteration_s(run_dir: Path, skip: int) -> float:
    """Mean `iteration_s` of iterations skip..last (metrics.jsonl)."""
    steady = read_jsonl(run_dir / "metrics.jsonl")[skip:]
    if not steady:
        raise RuntimeError(f"{run_dir}/metrics.jsonl: no iteration past the first {skip}")
    return sum(r["iteration_s"] for r in steady) / len(steady)


def trace_overhead(settings: Settings, prefix: str) -> dict[str, float]:
    """Sync runs with the trace off and on, alternating (module docstring); their mean iteration
    times and the ratio on / off."""
    times: dict[bool, list[float]] = {False: [], True: []}
    load_before = os.getloadavg()[0]
    for pair in range(TRACE_PAIRS):
        for trace in (False, True):
            suffix = f"_trace_{'on' if trace else 'off'}{pair}"
            progress(f"sync, trace {'on' if trace else 'off'} ({pair + 1} of {TRACE_PAIRS})")
            times[trace].append(mean_iteration_s(run_schedule("sync", settings, prefix, trace, suffix), settings.skip))
    off, on = (sum(times[t]) / len(times[t]) for t in (False, True))
    return {"iteration_s_trace_off": round(off, 4), "iteration_s_trace_on": round(on, 4),
            "trace_overhead": round(on / off - 1, 4), "runs_each": TRACE_PAIRS,
            "iteration_s_runs_off": [round(t, 4) for t in times[False]],
            "iteration_s_runs_on": [round(t, 4) for t in times[True]],
            "load_1min_before": round(load_before, 2), "load_1min_after": round(os.getloadavg()[0], 2)}


# ---- report ----------------------------------------------------------------------------------


def format_table(results: dict[str, dict], settings: Settings) -> str:
    """The schedules side by side, with their ratios against sync."""
    sync = results["sync"]
    rows: list[tuple[str, ...]] = [("", *results)]

    def row(label: str, fmt: str, get) -> None:
        rows.append((label, *(format(get(r), fmt) for r in results.values())))

    row("tokens/s", ",.0f", lambda r: r["tokens_per_s"])
    row("  / sync", ".2f", lambda r: r["tokens_per_s"] / sync["tokens_per_s"])
    row("iteration s (mean)", ".3f", lambda r: r["iteration_s"])
    row("  / sync", ".2f", lambda r: r["iteration_s"] / sync["iteration_s"])
    row("tokens / iteration", ",.0f", lambda r: r["tokens_per_iteration"])
    row("bubble ratio", ".3f", lambda r: r["bubble_ratio"])
    row("busy, rollout side", ".3f", lambda r: r["group_busy"]["rollout"])
    row("busy, train side", ".3f", lambda r: r["group_busy"]["train"])
    row("hidden s (overlap)", ".1f", lambda r: r["overlap_hidden_s"])
    stages = sorted({s for r in results.values() for s in r["busy"]}, key=lambda s: (s not in ROLLOUT_SIDE, s))
    for stage in stages:
        row(f"  {stage}", ".3f", lambda r, s=stage: r["busy"].get(s, 0.0))
    row("max staleness", "d", lambda r: r["max_staleness"])
    row("samples dropped", "d", lambda r: r["samples_dropped"])
    row("window s", ".1f", lambda r: r["window_s"])
    row("job s (whole run)", ".1f", lambda r: r["job_s"])
    row("run's CPU, cores", ".2f", lambda r: r.get("our_cores", float("nan")))
    row("other CPU, cores", ".2f", lambda r: r.get("other_cores", float("nan")))
    row("steal, cores", ".2f", lambda r: r.get("steal_cores", float("nan")))
    lines = [f"{label:<20}" + "".join(f"{v:>10}" for v in values) for label, *values in rows]
    ratio = results["stream1"]["tokens_per_s"] / sync["tokens_per_s"]
    notes = [
        f"stream1 / sync tokens/s: {ratio:.2f} (target >= {TARGET}: {'PASS' if ratio >= TARGET else 'MISS'})",
        *placement_notes(results),
        (f"steady state: iterations {settings.skip}..{settings.iterations - 1} of {settings.iterations} "
         f"(the first {settings.skip} left out: start-up, warm-up, pipeline fill)"),
        "tokens/s: prompt + response tokens of the global batch / iteration time (HybridFlow)",
        ("busy: step wall time / window (stages sharing a core can sum past 1); bubble ratio: "
         "1 - (merged busy time of the rollout side + of the train side) / (2 * window)"),
        ("CPU, cores: mean over the window, used by the run's processes, by everything else on the machine, and "
         "stolen by the hypervisor; other work or steal makes the figures noisy"),
        f"workload: {CONFIG} with {' '.join([*CORES, *WORKLOAD])}; placement (but auto1): {' '.join(PLACEMENT)}",
    ]
    return "\n".join([*lines, "", *notes])


def placement_notes(results: dict[str, dict]) -> list[str]:
    """What auto1 ran and how it compares: with sync, stream1 and (--placements) the best static
    with_rollout."""
    auto = results["auto1"]
    choice = auto["auto"] or {}
    sync, stream1 = results["sync"]["tokens_per_s"], results["stream1"]["tokens_per_s"]
    notes = [f"auto1: placement auto ran with_rollout={auto['with_rollout']} (predicted "
             f"{choice.get('predicted_iteration_s')} s per iteration); tokens/s / sync "
             f"{auto['tokens_per_s'] / sync:.2f}, / stream1 {auto['tokens_per_s'] / stream1:.2f}"]
    static = {column: r for column, r in results.items() if column.startswith("stream1_")}
    if static:
        best = max(static, key=lambda column: static[column]["tokens_per_s"])
        share = auto["tokens_per_s"] / static[best]["tokens_per_s"]
        notes += [", ".join(f"{column}: with_rollout={r['with_rollout']}" for column, r in static.items()),
                  f"auto1 / best static ({best}) tokens/s: {share:.2f} (target >= {AUTO_TARGET}: "
                  f"{'PASS' if share >= AUTO_TARGET else 'MISS'})"]
    return notes


def figures(results: dict[str, dict]) -> dict[str, float]:
    """The JSON line."""
    sync = results["sync"]["tokens_per_s"]
    out: dict[str, float] = {}
    for column, r in results.items():
        out[f"{column}_tokens_per_s"] = round(r["tokens_per_s"], 1)
    for column in ("stream0", "stream1", "auto1"):
        out[f"{column}_over_sync"] = round(results[column]["tokens_per_s"] / sync, 3)
    out["auto1_over_stream1"] = round(results["auto1"]["tokens_per_s"] / results["stream1"]["tokens_per_s"], 3)
    static = [r["tokens_per_s"] for column, r in results.items() if column.startswith("stream1_")]
    if static:
        out["auto1_over_best_static"] = round(results["auto1"]["tokens_per_s"] / max(static), 3)
    for column, r in results.items():
        out[f"bubble_ratio_{column}"] = round(r["bubble_ratio"], 3)
    for column, r in results.items():
        out[f"iteration_s_{column}"] = round(r["iteration_s"], 3)
    for column, r in results.items():
        out[f"other_cores_{column}"] = round(r.get("other_cores", -1.0), 3)
    return out


def progress(text: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"smoke run: {QUICK.iterations} iterations per schedule")
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last stdout line")
    parser.add_argument("--placements", action="store_true",
                        help="also stream1 under every static with_rollout the search tries (module docstring)")
    parser.add_argument("--trace-overhead", action="store_true",
                        help="instead of the schedules: sync with the trace off and on (module docstring)")
    args = parser.parse_args()
    settings = QUICK if args.quick else FULL
    prefix = f"bp{uuid.uuid4().hex[:8]}"  # this invocation's shared-memory names
    if args.trace_overhead:
        overhead = trace_overhead(settings, prefix)
        print(f"sync iteration s, trace off {overhead['iteration_s_trace_off']:.4f}, on "
              f"{overhead['iteration_s_trace_on']:.4f}: tracing costs {100 * overhead['trace_overhead']:+.2f}% "
              f"(mean of {TRACE_PAIRS} runs each, {settings.iterations} iterations, "
              f"the first {settings.skip} left out; "
              f"load average {overhead['load_1min_before']} before, {overhead['load_1min_after']} after)")
        if args.json:
            print(json.dumps(overhead))
        return
    results = {}
    for column in [*SCHEDULES, *(f"stream1_{i}" for i in range(len(STATIC)) if args.placements)]:
        started = time.monotonic()
        progress(f"{column}: {settings.iterations} iterations (runs/bench_pipeline_{settings.name}{column}.log)")
        results[column] = analyse(run_schedule(column, settings, prefix), settings.skip)
        progress(f"{column}: {results[column]['tokens_per_s']:,.0f} tokens/s ({time.monotonic() - started:.0f} s)")
    print(format_table(results, settings))
    if args.json:
        print(json.dumps(figures(results)))


if __name__ == "__main__":
    main()
