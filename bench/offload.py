"""Offload benchmark (issue 19): the main job with every stage in its own process, with the model
stages in two device groups taking turns and offloading everything (sync), and the same groups
pipelined (stream), side by side: seed 004's comparison on this machine.

Each column is one `stream-rlhf run configs/mllm_ppo.yaml` subprocess with a name of its own
(runs/bench_offload_<column>/), the config as shipped but for the iterations and:

    spawned       as separate, every process spawned (`STREAM_RLHF_START=spawn`): each imports torch
                  and transformers itself, as the launcher did before its fork server
    separate      nothing else: every stage its own process, schedule stream, overlap_depth as shipped
    full_offload  schedule=sync overlap_depth=0 (phases take turns), device groups, and every model
                  stage offloading all it holds after each step
    pipelined     schedule and overlap_depth as shipped, the same device groups and offloads, each
                  stage's onload prefetched during the other member's step (`prefetch: true`)

The device groups (`placement.device_groups`): `forwards` hosts the forward stages with a model
(ref_forward and critic_forward; actor_forward too where the job has one, in sync) and the reward
stage (a rule here: no model to offload, one process less), `trainers` hosts actor_train and
critic_train; both on the train side's cores (the config's `with_rollout`, critic_forward and
critic_train on rollout's, would split each group: a group is one process). Offload
(`placement.stages.<stage>.offload`, when: step): a forward's params, a trainer's params, grads and
optimizer state. On a CPU device nothing moves (the device is host memory): there the saving is the
processes a group merges, each of which carries the torch runtime.

Figures, from each run's summary.json (`memory`: `telemetry/memory.py`) and metrics.jsonl:

    iteration s      mean `iteration_s` (end of training to end of training), the first SKIP
                     iterations left out (process start-up, warm-up, pipeline fill)
    peak PSS, job    the largest sum of the job's processes' PSS at one sampling instant (the
                     broker and every stage process; the driver is not counted)
    grouped stages   the sum of the per-process peak PSS of the processes that run the grouped
                     stages: their own processes in `separate`, the two group processes otherwise
    processes        the job's processes (the broker included)
    offload+onload   what the stages' offload policies moved off and back onto their devices, MB
                     and seconds, summed over the stages (summary.json's `offload`; 0 on a CPU)
    onload hidden    of the prefetched stages' onload seconds, the fraction that ran during another
                     member's step (`onload_hidden_s` / `onload_s`; n/a when nothing moved)
    CUDA peak, job   (--device cuda) each process's torch.cuda.max_memory_allocated, summed over the
                     job's processes (a device group's members report their one process's peak);
                     an upper bound on what the job held at once
    peak_mem_groups  (JSON) the larger job peak of the two device-group columns, against the
                     target <= 0.6 x peak_mem_separate

MB: 2**20 bytes. Run from the repository root:

    .venv/bin/python bench/offload.py            # full run (~4 minutes on 2 cores): the table
    .venv/bin/python bench/offload.py --quick    # smoke run: 3 iterations each
    .venv/bin/python bench/offload.py --json     # the table, then one JSON object as the last line
    python bench/offload.py --device cuda --iterations 6 --columns separate full_offload pipelined
                                                 # on a GPU machine (scripts/gpu_checks.sh offload)

Every column's config is checked (its keys and values) before the first run starts. Each run's
output goes to runs/bench_offload_<column>.log (--quick: bench_offload_quick_<column>).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from pipeline import (  # bench/, beside this script
    assert_nothing_left,
    mean_iteration_s,
    progress,
    run_logged,
    shm_entries,
)

from stream_rlhf.config import ConfigError, load_config
from stream_rlhf.driver.dataflow import left_out_stages
from stream_rlhf.rl.config import RLJobConfig
from stream_rlhf.telemetry.memory import CUDA_PEAK

REPO = Path(__file__).resolve().parents[1]
CONFIG = "configs/mllm_ppo.yaml"
RUNS_DIR = REPO / "runs"
COLUMNS = ("spawned", "separate", "full_offload", "pipelined")
SPAWN = {"STREAM_RLHF_START": "spawn"}
"""The environment of the `spawned` column's run (`launch/process_start.py`)."""
FORWARDS = ("actor_forward", "ref_forward", "critic_forward")
"""The forward stages with a model, grouped as `forwards` (those the column's job has)."""
SCORERS = ("reward_forward",)
"""Also in `forwards`, with no offload policy (the reward stage's model, if any, stays on the CPU)."""
TRAINERS = ("actor_train", "critic_train")
"""Grouped as `trainers`; each offloads its params, grads and optimizer state."""
MEMORY_TARGET = 0.6
"""The device-group layout's job peak over separate stages', at most (issue 19)."""
RUN_TIMEOUT_S = 1200.0


@dataclass(frozen=True)
class Settings:
    name: str
    """Run names are bench_offload_<name><column>."""
    iterations: int
    """Iterations of each run."""
    skip: int
    """Leading iterations left out of the mean iteration time."""
    device: str = "cpu"
    """`placement.device` of every column (cpu, or cuda on a GPU machine)."""


FULL = Settings(name="", iterations=10, skip=2)
QUICK = Settings(name="quick_", iterations=3, skip=1)


# ---- the columns' configs ----------------------------------------------------------------------


def schedule_overrides(column: str) -> list[str]:
    """What sets the column's schedule (separate and pipelined keep the config's)."""
    if column not in COLUMNS:
        raise ValueError(f"column {column!r}: one of {', '.join(COLUMNS)}")
    return ["schedule=sync", "overlap_depth=0"] if column == "full_offload" else []


def group_overrides(stages: list[str], prefetch: bool = False) -> list[str]:
    """The device groups and offload policies over `stages` (the model stages the job has), each
    stage's onload prefetched with `prefetch`."""
    forwards = [s for s in FORWARDS if s in stages]
    trainers = [s for s in TRAINERS if s in stages]
    groups = {"forwards": forwards + [s for s in SCORERS if s in stages], "trainers": trainers}
    flow = ", ".join(f"{name}: [{', '.join(members)}]" for name, members in groups.items() if members)
    out = [f"placement.device_groups={{{flow}}}", "placement.with_rollout=[]"]  # a group runs on one side's cores
    ahead = ", prefetch: true" if prefetch else ""
    for stage in forwards:
        out.append(f"placement.stages.{stage}.offload={{what: [params], when: step{ahead}}}")
    for stage in trainers:
        out.append(f"placement.stages.{stage}.offload={{what: [params, grads, optimizer], when: step{ahead}}}")
    return out


def model_stages(cfg: RLJobConfig) -> list[str]:
    """The stages of FORWARDS, SCORERS and TRAINERS that `cfg`'s job runs."""
    left_out = left_out_stages(cfg)
    trainers = [s for s in TRAINERS if s == "actor_train" or cfg.algorithm.uses_critic]
    return [s for s in (*FORWARDS, *SCORERS) if s not in left_out] + trainers


def column_overrides(column: str, settings: Settings, prefix: str) -> list[str]:
    """Every `--set` of the column's run; its config is built from them (a bad key or value is a
    ConfigError naming it, before anything runs)."""
    own = [f"name={run_name(column, settings)}", f"iterations={settings.iterations}",
           f"broker.shm_prefix={prefix}", f"placement.device={settings.device}", *schedule_overrides(column)]
    if column not in ("spawned", "separate"):
        own += group_overrides(model_stages(load_config(RLJobConfig, REPO / CONFIG, own)),
                               prefetch=column == "pipelined")
    load_config(RLJobConfig, REPO / CONFIG, own)
    return own


def run_name(column: str, settings: Settings) -> str:
    """The column's run folder under runs/ (a CUDA run's name says so)."""
    device = "" if settings.device == "cpu" else f"{settings.device}_"
    return f"bench_offload_{settings.name}{device}{column}"


# ---- running -----------------------------------------------------------------------------------


def run_column(overrides: list[str], prefix: str, env: dict[str, str],
               watch: Callable[[int], Callable[[], None]] | None = None) -> Path:
    """One `stream-rlhf run` subprocess with `env` added to this environment (and `watch`, as
    run_logged takes it); returns its run folder. Fails when the run does, or when it left anything
    of its own in /dev/shm."""
    name = next(o for o in overrides if o.startswith("name=")).removeprefix("name=")
    log_path = RUNS_DIR / f"{name}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "stream_rlhf.cli", "run", CONFIG, *(f"--set={o}" for o in overrides)]
    before = shm_entries()
    run_logged(command, log_path, env, watch, timeout_s=RUN_TIMEOUT_S)
    assert_nothing_left(before, prefix, name)
    return RUNS_DIR / name


# ---- figures -----------------------------------------------------------------------------------


def process_stage(process: str) -> str:
    """The stage (or device group) a process runs: `critic_train-0.rank1` -> `critic_train`."""
    return process.partition(".rank")[0].rpartition("-")[0]


def grouped_pss_mb(memory: dict) -> float:
    """The per-process peak PSS summed over the processes that run a grouped stage, or a group."""
    grouped = {*FORWARDS, *SCORERS, *TRAINERS, "forwards", "trainers"}
    return sum(p["peak_pss_mb"] for name, p in memory["per_process"].items() if process_stage(name) in grouped)


def offload_moved(summary: dict) -> tuple[float, float]:
    """MB and seconds the offload policies moved, off and back on, over every stage (NaN: a summary
    written before the run summary had its `offload` block; None there: no stage had a policy)."""
    if "offload" not in summary:
        return math.nan, math.nan
    stages = (summary["offload"] or {}).values()
    return sum(m["offload_mb"] + m["onload_mb"] for m in stages), sum(m["offload_s"] + m["onload_s"] for m in stages)


def onload_hidden(summary: dict) -> float:
    """The fraction of the prefetched stages' onload time that ran during another member's step
    (NaN when no stage prefetched or nothing moved: on a CPU)."""
    stages = [m for m in (summary.get("offload") or {}).values() if "onload_hidden_s" in m]
    onload_s = sum(m["onload_s"] for m in stages)
    return sum(m["onload_hidden_s"] for m in stages) / onload_s if onload_s > 0 else math.nan


def cuda_peak_mb(memory: dict, groups: dict[str, list[str]]) -> float:
    """The CUDA peaks the stages reported, summed over their processes: the members of a device
    group share one process, and so its one peak (NaN when no stage reported one: not on CUDA)."""
    peaks = memory.get(CUDA_PEAK) or {}
    if not peaks:
        return math.nan
    process_of = {stage: group for group, members in groups.items() for stage in members}
    per_process: dict[str, float] = {}
    for stage, mb in peaks.items():
        process = process_of.get(stage, stage)
        per_process[process] = max(per_process.get(process, 0.0), mb)
    return sum(per_process.values())


def analyse(run_dir: Path, skip: int, groups: dict[str, list[str]]) -> dict:
    """The figures of one run (module docstring); `groups`: its config's device groups."""
    summary = json.loads((run_dir / "summary.json").read_text())
    memory = summary.get("memory")
    if not memory or not memory["processes"]:
        raise RuntimeError(f"{run_dir}/summary.json: no memory block (not the local launcher, or no sample)")
    moved_mb, moving_s = offload_moved(summary)
    return {
        "cuda_peak_mb": cuda_peak_mb(memory, groups),
        "iteration_s": mean_iteration_s(run_dir, skip),
        "peak_pss_mb": memory["peak_pss_mb"],
        "peak_rss_mb": memory["peak_rss_mb"],
        "grouped_pss_mb": grouped_pss_mb(memory),
        "processes": memory["processes"],
        "moved_mb": moved_mb,
        "moving_s": moving_s,
        "onload_hidden": onload_hidden(summary),
        "process_names": sorted(memory["per_process"]),
        "tokens_per_s": summary["tokens_per_s"],
        "samples_dropped": summary["samples_dropped"],
        "eval_reward_after": summary["eval_reward_after"],
        "job_s": summary["job_s"],
    }


def figures(results: dict[str, dict]) -> dict[str, float]:
    """The JSON line."""
    separate = results["separate"]
    out: dict[str, float] = {"peak_mem_separate": separate["peak_pss_mb"]}
    grouped = [results[c]["peak_pss_mb"] for c in ("full_offload", "pipelined") if c in results]
    if grouped:
        out["peak_mem_groups"] = max(grouped)
        out["peak_mem_groups_over_separate"] = round(max(grouped) / separate["peak_pss_mb"], 3)
        if "spawned" in results:
            out["peak_mem_groups_over_spawned"] = round(max(grouped) / results["spawned"]["peak_pss_mb"], 3)
    for column, r in results.items():
        out[f"iter_s_{column}"] = round(r["iteration_s"], 3)
    for column, r in results.items():
        out[f"peak_mem_{column}"] = r["peak_pss_mb"]
    for column, r in results.items():
        out[f"grouped_stages_mem_{column}"] = round(r["grouped_pss_mb"], 1)
    for column, r in results.items():
        out[f"processes_{column}"] = r["processes"]
    for column, r in results.items():
        if not math.isnan(r["cuda_peak_mb"]):
            out[f"cuda_peak_mb_{column}"] = round(r["cuda_peak_mb"], 1)
    if "pipelined" in results:
        out["offload_hidden_fraction_pipelined"] = results["pipelined"]["onload_hidden"]
    return out


ROWS: list[tuple[str, str, str, bool]] = [
    ("iteration s (mean)", "iteration_s", ".3f", True),
    ("peak PSS, job MB", "peak_pss_mb", ",.0f", True),
    ("peak RSS, job MB", "peak_rss_mb", ",.0f", False),
    ("grouped stages MB", "grouped_pss_mb", ",.0f", True),
    ("CUDA peak, job MB", "cuda_peak_mb", ",.0f", True),
    ("processes", "processes", "d", False),
    ("offload+onload MB", "moved_mb", ",.0f", False),
    ("offload+onload s", "moving_s", ".2f", False),
    ("onload hidden", "onload_hidden", ".0%", False),
    ("tokens/s", "tokens_per_s", ",.0f", False),
    ("samples dropped", "samples_dropped", "d", False),
    ("eval reward after", "eval_reward_after", ".3f", False),
    ("job s (whole run)", "job_s", ".1f", False),
]
"""The table's rows: label, figure, format, and whether a row of the ratio to separate follows."""


def format_table(results: dict[str, dict], settings: Settings) -> str:
    """The columns side by side, with their ratios against separate."""
    cells: list[tuple[str, list[str]]] = [("", list(results))]
    for label, key, fmt, ratio in ROWS:
        if all(isinstance(r[key], float) and math.isnan(r[key]) for r in results.values()):
            continue  # a figure no column has (the CUDA peak on a CPU)
        cells.append((label, [format(r[key], fmt) for r in results.values()]))
        if ratio:
            cells.append(("  / separate", [f"{r[key] / results['separate'][key]:.2f}" for r in results.values()]))
    lines = [f"{label:<20}" + "".join(f"{v:>14}" for v in values) for label, values in cells]
    notes = [f"{column}: {', '.join(r['process_names'])}" for column, r in results.items()]
    out = figures(results)
    if "peak_mem_groups" in out:
        ratio = out["peak_mem_groups_over_separate"]
        notes.append(f"device groups' peak / separate: {ratio:.2f} (target <= {MEMORY_TARGET}: "
                     f"{'PASS' if ratio <= MEMORY_TARGET else 'MISS'})")
        if "peak_mem_groups_over_spawned" in out:
            ratio = out["peak_mem_groups_over_spawned"]
            notes.append(f"device groups' peak / separate spawned (the launcher before its fork server): {ratio:.2f} "
                         f"(target <= {MEMORY_TARGET}: {'PASS' if ratio <= MEMORY_TARGET else 'MISS'})")
    if {"full_offload", "pipelined"} <= results.keys():
        faster = results["pipelined"]["iteration_s"] < results["full_offload"]["iteration_s"]
        notes.append(f"pipelined faster than full offload: {'PASS' if faster else 'MISS'}")
    notes += [
        (f"iterations {settings.skip}..{settings.iterations - 1} of {settings.iterations} timed; peak PSS: the "
         "largest sum over the job's processes at one 0.5 s sample; grouped stages: per-process peaks summed"),
        f"workload: {CONFIG} as shipped, {settings.iterations} iterations, placement.device={settings.device}",
    ]
    return "\n".join([*lines, "", *notes])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"smoke run: {QUICK.iterations} iterations per column")
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last stdout line")
    parser.add_argument("--columns", nargs="+", choices=COLUMNS, default=list(COLUMNS),
                        help="run only these (separate always runs: the ratios are against it)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="placement.device of every column (cuda: the CUDA peak row too)")
    parser.add_argument("--iterations", type=int, help="iterations of each run (default: 10, --quick 3)")
    args = parser.parse_args()
    settings = QUICK if args.quick else FULL
    if args.iterations is not None:
        if args.iterations <= settings.skip + 1:
            parser.error(f"--iterations {args.iterations}: more than {settings.skip + 1} (the first "
                         f"{settings.skip} are not timed)")
        settings = replace(settings, iterations=args.iterations)
    settings = replace(settings, device=args.device)
    prefix = f"bo{uuid.uuid4().hex[:8]}"  # this invocation's shared-memory names
    columns = [c for c in COLUMNS if c == "separate" or c in args.columns]
    try:
        overrides = {column: column_overrides(column, settings, prefix) for column in columns}
    except ConfigError as exc:
        sys.exit(f"bench/offload.py: a column's config is not valid: {exc}")
    results = {}
    for column in columns:
        started = time.monotonic()
        progress(f"{column}: {settings.iterations} iterations (runs/{run_name(column, settings)}.log; "
                 f"load average {os.getloadavg()[0]:.2f})")
        groups = load_config(RLJobConfig, REPO / CONFIG, overrides[column]).placement.device_groups
        results[column] = analyse(run_column(overrides[column], prefix, SPAWN if column == "spawned" else {}),
                                  settings.skip, groups)
        progress(f"{column}: {results[column]['iteration_s']:.3f} s/iteration, peak PSS "
                 f"{results[column]['peak_pss_mb']:,.0f} MB ({time.monotonic() - started:.0f} s)")
    print(format_table(results, settings))
    if args.json:
        print(json.dumps(figures(results)))


if __name__ == "__main__":
    main()
