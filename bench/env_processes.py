"""A tool that computes in Python: environments in the rollout process against `env.processes`.

A verifier or simulator written in pure Python holds the GIL while it works; in the rollout
process it competes with the sampler's decode loop, in worker processes of its own it does not.
This script drives the episode engine as `agentic_rollout.py` does (no broker, no trainer) on
configs/text_tool_grpo.yaml's warm-started policy, two mini-batches in flight (`stream`, as
shipped), with the calculator computing CPU_S of pure Python per call (`env.options.cpu_s`, CPU
time of its thread: a fixed amount of work) and no sleep, in columns that take turns, ROUNDS times:

    free         a tool that costs nothing (cpu_s 0): the ceiling
    threads      env.processes: 0, the calls in the rollout process's threads (the baseline)
    processes1   env.processes: 1
    processes2   env.processes: 2

Figures: episode tokens/s (prompt, policy and observation tokens of every episode / the column's
wall seconds), seconds and environment steps (tool calls and final answers) per mini-batch, and
the ratio against threads. The worker processes are
started before the clock starts (rollout starts them at setup). On a machine with few cores the
workers' computing competes with the sampler for cores rather than for the GIL; the table says
how many cores there were.

    .venv/bin/python bench/env_processes.py            # about a minute on 2 idle cores
    .venv/bin/python bench/env_processes.py --json     # and one JSON line
    .venv/bin/python bench/env_processes.py --quick    # smoke: 2 mini-batches, 1 round, a 40-step warm start
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import replace
from pathlib import Path

import torch
from agentic_rollout import json_figures, minibatches, run_column, table_row, table_rows  # bench/, beside this
from pipeline import progress

from stream_rlhf.backends.decode_attention import use_decode_attention
from stream_rlhf.backends.torch_rollout import SamplingParams
from stream_rlhf.config import load_config
from stream_rlhf.data.tokenizer import load_tokenizer, stop_token_ids
from stream_rlhf.driver.warm_start import warm_start
from stream_rlhf.envs.process_envs import ProcessEnvs
from stream_rlhf.envs.stepper import EnvStepper
from stream_rlhf.models.checkpoint import load_policy
from stream_rlhf.rl.config import RLJobConfig

REPO = Path(__file__).resolve().parents[1]
CONFIG = "configs/text_tool_grpo.yaml"
CPU_S = 0.005
IN_FLIGHT = 2
MINIBATCHES = 6
ROUNDS = 2
QUICK_SETS = ["model.warm_start.steps=40"]
COLUMNS = {"free": (0.0, 0), "threads": (CPU_S, 0), "processes1": (CPU_S, 1), "processes2": (CPU_S, 2)}
"""column -> (the tool's cpu_s, env.processes)."""
BASELINE = "threads"


def measure(quick: bool) -> dict[str, dict]:
    sets = ["env.options.latency_s=0.0", *(QUICK_SETS if quick else [])]
    cfg = load_config(RLJobConfig, REPO / CONFIG, sets)
    count, rounds = (2, 1) if quick else (MINIBATCHES, ROUNDS)
    checkpoint = warm_start(cfg)
    torch.manual_seed(cfg.seed)
    model = load_policy(str(checkpoint)).eval()
    use_decode_attention(model)
    tokenizer = load_tokenizer(str(checkpoint))
    stops = stop_token_ids(tokenizer, cfg.rollout.stop, cfg.data.chat_template, str(checkpoint))
    params = SamplingParams(cfg.rollout.temperature, cfg.rollout.top_p, cfg.rollout.max_new_tokens, stops,
                            tokenizer.pad_token_id)
    work = minibatches(cfg, tokenizer, count)
    batch = cfg.rollout_batch
    threads = cfg.env.threads(batch.prompts_per_minibatch * batch.samples_per_prompt * IN_FLIGHT)
    envs = {column: replace(cfg.env, processes=processes, options={**cfg.env.options, "cpu_s": cpu_s})
            for column, (cpu_s, processes) in COLUMNS.items()}
    pools = {column: ProcessEnvs(env, threads) for column, env in envs.items() if env.processes}
    stepper = EnvStepper(cfg.env.step_timeout_s, threads)
    totals = {column: [0.0, 0, 0] for column in COLUMNS}
    try:
        with torch.inference_mode():
            for round_ in range(rounds):
                for column, env in envs.items():
                    pool = pools.get(column)
                    figures = run_column(env, model, tokenizer, params, work, IN_FLIGHT, stepper,
                                         make=pool.make if pool else None)
                    totals[column] = [a + b for a, b in zip(totals[column], figures)]
                progress(f"round {round_ + 1}/{rounds}: " + ", ".join(
                    f"{c} {t[1] / t[0]:,.0f} tokens/s" for c, t in totals.items()))
    finally:
        stepper.close()
        for pool in pools.values():
            pool.close()
    minibatches_run = rounds * count
    return {column: {"episode_tokens_per_s": tokens / seconds, "s_per_minibatch": seconds / minibatches_run,
                     "env_steps_per_minibatch": calls / minibatches_run}
            for column, (seconds, tokens, calls) in totals.items()}


def format_table(results: dict[str, dict]) -> str:
    """The columns side by side, with their ratios against threads."""
    steps = table_row("env steps / mini-batch", [f"{r['env_steps_per_minibatch']:.1f}" for r in results.values()])
    note = (f"{1000 * CPU_S:.0f} ms of pure Python per tool call; {IN_FLIGHT} mini-batches of {CONFIG}'s size in "
            f"flight; {os.cpu_count()} cores; no trainer, no broker")
    return "\n".join([*table_rows(results, BASELINE), steps, "", note])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last stdout line")
    parser.add_argument("--quick", action="store_true", help="smoke: 2 mini-batches, 1 round, a 40-step warm start")
    args = parser.parse_args()
    torch.set_num_threads(1)  # as a stage process on its one core
    results = measure(args.quick)
    print(format_table(results))
    if args.json:
        print(json.dumps(json_figures(results, BASELINE, cpu_s=CPU_S)))

if __name__ == "__main__":
    sys.exit(main())
