"""Agentic benchmark: tool latency hidden by streaming episodes, against lock-step episodes.

The workload is configs/text_tool_grpo.yaml (GRPO, the calculator task: sums of 3-4 operands up
to 999 with a `calc:` tool) with a tool that sleeps LATENCY_S = 50 ms per call
(`env.options.latency_s`). Each column is one `stream-rlhf run` subprocess of that config with the
same seed and warm start, so the same model and prompts (runs/bench_agentic_<column>/):

    lockstep   env.schedule=lockstep: at every turn, each episode of a mini-batch waits for the
               slowest tool call of the mini-batch before any goes on, and rollout runs one
               mini-batch at a time (a synchronous engine); the baseline
    stream1    env.schedule=stream with env.minibatches_in_flight=1: an episode goes on as soon
               as its own call returns, and rollout keeps generating for the other episodes of
               its mini-batch while one waits
    stream     env.schedule=stream as the config ships it (env.minibatches_in_flight): the
               episodes of several mini-batches in flight on one sampler, so while one
               mini-batch's episodes wait for their tools the next one's decode, and each
               mini-batch is published as soon as its own episodes have ended

All pin the placement (PLACEMENT: `separated`; on the CPU prompts + rollout on core 0, every other
stage on core 1) so that the figure does not drift with what `placement: auto` picks, and evaluate on
THROUGHPUT_EVAL_PROMPTS = 32 held-out prompts only (their eval rewards are no figure here).

Figures per column, over iterations 2..15 of 16 (the first 2 left out: start-up; 16, not fewer,
because single runs on a shared 2-core VM move by 10% or more):

    episode tokens/s   prompt + policy + observation tokens of those iterations' episodes
                       (actor_train's metrics.jsonl `tokens`: the packed sequences it trains on)
                       / the seconds rollout spent producing them (the union of rollout's steps
                       of those iterations, trace.json: a second with two mini-batches in flight
                       counts once): rollout's own throughput, where the tool latency lands
    rollout busy s / mini-batch   that union / the mini-batches
    mini-batch s       a mini-batch's step, from its start to its publish (longer than the busy
                       share when several are in flight)
    iteration s (mean `iteration_s`), tokens / iteration
    episodes failed    summary.json `episodes_failed` (by reason), which must be empty

speedup = stream / lockstep episode tokens/s (the issue's target: >= 2).

--rewards adds the learning check (it takes longer): eval reward with the tool against the same
job without it, seeds 0 and 1, the tool at no latency:

    tool       the config as shipped: episodes, the calculator's final-answer reward
    no_tool    env=null, reward.function=stream_rlhf.data.arithmetic:reward, task.tool_fraction=0:
               one answer per prompt, the sum done in the head, a warm start of direct answers

Each one's summary.json `eval_reward_before` / `eval_reward_after` (held-out prompts, sampled at
the rollout temperature); the target: tool after > no_tool after, in the mean over the seeds.

    .venv/bin/python bench/agentic.py              # the three columns (~2 minutes on 2 idle cores)
    .venv/bin/python bench/agentic.py --rewards    # and the rewards: 2 x 2 full runs (~6 minutes more)
    .venv/bin/python bench/agentic.py --quick --json   # smoke: 3 iterations, a 40-step warm start
    .venv/bin/python bench/agentic.py --vllm .venv-vllm/bin/python   # the columns with rollout on vLLM
    python bench/agentic.py --device cuda --json   # every torch stage on cuda:0 (scripts/gpu_checks.sh agentic)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import uuid
from dataclasses import dataclass, replace
from pathlib import Path

from pipeline import progress, read_jsonl, run_logged  # bench/, beside this script

REPO = Path(__file__).resolve().parents[1]
CONFIG = "configs/text_tool_grpo.yaml"
RUNS_DIR = REPO / "runs"
BASELINE = "lockstep"
COLUMNS = ("lockstep", "stream1", "stream")
LATENCY_S = 0.05
TARGET = 2.0
"""stream / lockstep episode tokens/s expected."""
PLACEMENT = ["placement.mode=separated", "placement.with_rollout=[]", "placement.device_groups={}"]
CPU_CORES = ["placement.rollout_cores=[0]", "placement.train_cores=[1]"]
"""On the CPU (not with --device cuda): rollout's core and the other stages' core."""
THROUGHPUT_EVAL_PROMPTS = 32
"""The throughput columns' evaluations (not part of their figures) are kept short."""
NO_TOOL = ["env=null", "reward.function=stream_rlhf.data.arithmetic:reward", "task.tool_fraction=0"]


@dataclass(frozen=True)
class Settings:
    name: str
    """Run names are bench_agentic_<name><column>."""
    iterations: int
    """Iterations of each throughput run."""
    skip: int
    """Leading iterations left out of the figures."""
    seeds: tuple[int, ...]
    """--rewards: the seeds of each reward column."""
    eval_prompts: int
    """--rewards: held-out prompts of each evaluation."""
    reward_sets: tuple[str, ...] = ()
    """--rewards: `--set`s of the reward runs (none: the config's iterations)."""
    warm_start: tuple[str, ...] = ()
    """`--set`s of the warm start (none: the config's)."""
    rollout: tuple[str, ...] = ()
    """`--set`s of the throughput columns' rollout engine (none: the config's, the torch sampler)."""
    device: str = "cpu"
    """`placement.device` of the throughput columns (cuda: every torch stage on cuda:0)."""

    @property
    def placement(self) -> list[str]:
        """The throughput columns' pinned placement."""
        return [*PLACEMENT, *(CPU_CORES if self.device == "cpu" else [f"placement.device={self.device}"])]


FULL = Settings(name="", iterations=16, skip=2, seeds=(0, 1), eval_prompts=256)
QUICK = Settings(name="quick_", iterations=3, skip=1, seeds=(0,), eval_prompts=32, reward_sets=("iterations=3",),
                 warm_start=("model.warm_start.steps=40",))  # a warm start of its own, built in seconds


def overrides(column: str, settings: Settings, prefix: str, seed: int = 0) -> list[str]:
    """The `--set`s of one run: a throughput column (COLUMNS) or a reward column
    (tool, no_tool) at `seed`."""
    name = f"bench_agentic_{settings.name}{column}" + (f"_s{seed}" if column in ("tool", "no_tool") else "")
    sets = [f"name={name}", f"seed={seed}", f"broker.shm_prefix={prefix}{column[:2]}{seed}", *settings.warm_start]
    if column in COLUMNS:
        schedule = ["env.schedule=lockstep"] if column == "lockstep" else ["env.schedule=stream"]
        schedule += ["env.minibatches_in_flight=1"] if column == "stream1" else []
        return [*sets, f"iterations={settings.iterations}", *schedule, *settings.rollout, *settings.placement,
                f"env.options.latency_s={LATENCY_S}", f"task.eval_prompts={THROUGHPUT_EVAL_PROMPTS}"]
    sets += [f"task.eval_prompts={settings.eval_prompts}", *settings.reward_sets]
    return sets + (NO_TOOL if column == "no_tool" else [])


def run(sets: list[str]) -> Path:
    """One `stream-rlhf run` of CONFIG with `sets`; its run folder."""
    name = next(s.split("=", 1)[1] for s in sets if s.startswith("name="))
    command = [sys.executable, "-m", "stream_rlhf.cli", "run", CONFIG, *(f"--set={s}" for s in sets)]
    RUNS_DIR.mkdir(exist_ok=True)
    run_logged(command, RUNS_DIR / f"{name}.log")
    return RUNS_DIR / name


def rollout_steps(events: list[dict], iterations: set[int]) -> list[tuple[float, float]]:
    """(start, end) seconds of rollout's steps of `iterations`, one per mini-batch (every
    instance's, by its leader's event)."""
    return [(e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6) for e in events
            if e.get("ph") == "X" and e.get("cat") == "step" and e["args"].get("stage") == "rollout"
            and e["args"].get("rank", 0) == 0 and e["args"].get("iteration") in iterations]


def busy_seconds(spans: list[tuple[float, float]]) -> float:
    """The length of the union of `spans`: time during which at least one was in progress."""
    busy, reached = 0.0, float("-inf")
    for start, end in sorted(spans):
        busy += max(0.0, end - max(start, reached))
        reached = max(reached, end)
    return busy


def analyse(run_dir: Path, skip: int) -> dict:
    """The throughput figures of one run over iterations skip.. (module docstring)."""
    metrics = read_jsonl(run_dir / "metrics.jsonl")[skip:]
    if not metrics:
        raise RuntimeError(f"{run_dir}/metrics.jsonl: no iteration past the first {skip}")
    iterations = {r["iteration"] for r in metrics}
    events = json.loads((run_dir / "trace.json").read_text())["traceEvents"]
    steps = rollout_steps(events, iterations)
    if not steps:
        raise RuntimeError(f"{run_dir}/trace.json: no rollout step of iterations {sorted(iterations)}")
    tokens, busy = sum(r["tokens"] for r in metrics), busy_seconds(steps)
    summary = json.loads((run_dir / "summary.json").read_text())
    return {"episode_tokens_per_s": tokens / busy, "rollout_busy_s_per_minibatch": busy / len(steps),
            "minibatch_s": sum(end - start for start, end in steps) / len(steps),
            "iteration_s": sum(r["iteration_s"] for r in metrics) / len(metrics),
            "tokens_per_iteration": tokens / len(metrics), "episodes_failed": summary.get("episodes_failed", {}),
            "samples_trained": summary["samples_trained"]}


def rewards(summary: dict) -> dict:
    return {"before": summary["eval_reward_before"], "after": summary["eval_reward_after"]}


def format_table(results: dict[str, dict], settings: Settings) -> str:
    """The throughput columns side by side, with their ratios against the baseline."""
    base = results[BASELINE]
    rows: list[tuple[str, ...]] = [("", *results)]

    def row(label: str, fmt: str, get) -> None:
        rows.append((label, *(format(get(r), fmt) for r in results.values())))

    row("episode tokens/s", ",.0f", lambda r: r["episode_tokens_per_s"])
    row(f"  / {BASELINE}", ".2f", lambda r: r["episode_tokens_per_s"] / base["episode_tokens_per_s"])
    row("rollout busy s / mini-b.", ".3f", lambda r: r["rollout_busy_s_per_minibatch"])
    row("mini-batch s", ".3f", lambda r: r["minibatch_s"])
    row("iteration s (mean)", ".3f", lambda r: r["iteration_s"])
    row(f"  / {BASELINE}", ".2f", lambda r: r["iteration_s"] / base["iteration_s"])
    row("tokens / iteration", ",.0f", lambda r: r["tokens_per_iteration"])
    row("samples trained", "d", lambda r: r["samples_trained"])
    row("episodes failed", "d", lambda r: sum(r["episodes_failed"].values()))
    lines = [f"{label:<25}" + "".join(f"{v:>12}" for v in values) for label, *values in rows]
    speedup = results["stream"]["episode_tokens_per_s"] / base["episode_tokens_per_s"]
    return "\n".join([*lines, "", f"speedup (stream / {BASELINE} episode tokens/s): {speedup:.2f} "
                      f"(target >= {TARGET}: {'PASS' if speedup >= TARGET else 'MISS'}); tool latency "
                      f"{1000 * LATENCY_S:.0f} ms per call; workload: {CONFIG} with "
                      f"{' '.join([*settings.rollout, *settings.placement])}"])


def format_rewards(columns: dict[str, list[dict]]) -> str:
    """Eval reward before and after RL per reward column, the mean over the seeds and each seed's."""
    lines = [f"{'':<10} {'eval before':>11} {'eval after':>10} {'gain':>7}  after per seed"]
    for column, per_seed in columns.items():
        before, after = (sum(r[k] for r in per_seed) / len(per_seed) for k in ("before", "after"))
        lines.append(f"{column:<10} {before:>11.3f} {after:>10.3f} {after - before:>+7.3f}  "
                     + " ".join(f"{r['after']:.3f}" for r in per_seed))
    if {"tool", "no_tool"} <= set(columns):
        tool, no_tool = (sum(r["after"] for r in columns[c]) / len(columns[c]) for c in ("tool", "no_tool"))
        verdict = "PASS" if tool > no_tool else "MISS"
        lines.append(f"tool after > no_tool after: {verdict} ({tool:.3f} vs {no_tool:.3f})")
    return "\n".join(lines)


def figures(results: dict[str, dict], reward_columns: dict[str, list[dict]], settings: Settings) -> dict:
    """The JSON line."""
    out: dict = {"baseline": BASELINE, "latency_s": LATENCY_S, "rollout": "vllm" if settings.rollout else "torch",
                 "device": settings.device,
                 "speedup": round(results["stream"]["episode_tokens_per_s"]
                                  / results[BASELINE]["episode_tokens_per_s"], 3)}
    for column, r in results.items():
        out[f"{column}_episode_tokens_per_s"] = round(r["episode_tokens_per_s"], 1)
        out[f"{column}_iteration_s"] = round(r["iteration_s"], 3)
        out[f"{column}_episodes_failed"] = r["episodes_failed"]
    for column, per_seed in reward_columns.items():
        out[f"{column}_eval_reward_before"] = [r["before"] for r in per_seed]
        out[f"{column}_eval_reward_after"] = [r["after"] for r in per_seed]
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help=f"smoke run: {QUICK.iterations} iterations, a 40-step warm start; with --rewards one seed")
    parser.add_argument("--rewards", action="store_true",
                        help="also eval reward with the tool against without it (2 seeds, full runs: slow)")
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last stdout line")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                        help="placement.device of the throughput columns (cuda: scripts/gpu_checks.sh agentic)")
    parser.add_argument("--vllm", metavar="PYTHON",
                        help="the throughput columns with rollout.backend=vllm, its engine run by PYTHON (a Python "
                             "with vLLM: .venv-vllm/bin/python here) and 32-token KV blocks")
    return parser.parse_args(argv)


def vllm_settings(settings: Settings, python: str) -> Settings:
    """`settings` with rollout on vLLM (runs bench_agentic_<name>vllm_<column>)."""
    return replace(settings, name=f"{settings.name}vllm_",
                   rollout=("rollout.backend=vllm", f"rollout.vllm.python={python}", "rollout.vllm.block_size=32"))


def main() -> None:
    args = parse_args()
    settings = QUICK if args.quick else FULL
    if args.vllm:
        settings = vllm_settings(settings, args.vllm)
    if args.device != "cpu":
        settings = replace(settings, name=f"{settings.name}{args.device}_", device=args.device)
    prefix = f"ba{uuid.uuid4().hex[:6]}"  # this invocation's shared-memory names
    results = {}
    for column in COLUMNS:
        started = time.monotonic()
        progress(f"{column}: {settings.iterations} iterations (runs/bench_agentic_{settings.name}{column}.log)")
        results[column] = analyse(run(overrides(column, settings, prefix)), settings.skip)
        progress(f"{column}: {results[column]['episode_tokens_per_s']:,.0f} episode tokens/s "
                 f"({time.monotonic() - started:.0f} s)")
    reward_columns: dict[str, list[dict]] = {}
    for column in ("tool", "no_tool") if args.rewards else ():
        for seed in settings.seeds:
            progress(f"{column} seed {seed}")
            run_dir = run(overrides(column, settings, prefix, seed))
            reward_columns.setdefault(column, []).append(rewards(json.loads((run_dir / "summary.json").read_text())))
    print(format_table(results, settings))
    if reward_columns:
        print()
        print(format_rewards(reward_columns))
    if args.json:
        print(json.dumps(figures(results, reward_columns, settings)))


if __name__ == "__main__":
    main()
