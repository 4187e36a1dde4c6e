"""LoRA adapters (`actor.lora`) against training the whole policy, on the arithmetic task.

Each column is one `stream-rlhf run configs/text_grpo.yaml` subprocess (the same warm-started tiny
model, prompts, batch shape and iteration count; runs/bench_lora_<column>_s<seed>/):

    full        the config as shipped: every weight of the policy trains (actor.lr 2e-4)
    lora        actor.lora rank 8, alpha 16 on every projection of the decoder layers, actor.lr 1e-3
                (5x: only a low-rank update moves, from zero; over 2 seeds 2e-3 gained half as much
                and 5e-3 and 1e-2 lost reward)
    lora_base   lora with algorithm.kl.reference=lora_base: the KL's reference log-probs from the
                actor's model with its adapters off, no ref_forward stage (one process and model fewer)

Figures per column, means over the seeds: the eval reward (sampled answers on `--eval-prompts`
held-out prompts) before and after RL and its gain, the greedy eval reward after, the parameters
the actor trains and the AdamW state they hold (two fp32 moments each), the job's processes and
their peak host memory (PSS summed, summary.json's `memory`), the mean iteration seconds and
tokens/s after the first iteration. The ratios are each column's over the baseline `full`'s. On
this tiny model (0.4M parameters, hidden 128) the time differs little either way: the adapters'
two extra matmuls per layer cost about what the frozen weights' skipped gradients save.

    .venv/bin/python bench/lora.py                   # 3 columns x seeds 0 1 (~3 minutes on 2 idle cores)
    .venv/bin/python bench/lora.py --seeds 0 --json
    .venv/bin/python bench/lora.py --quick --json    # smoke: seed 0, 2 iterations, a 40-step warm start,
                                                     # 64 eval prompts
"""

from __future__ import annotations

import argparse
from pathlib import Path

from job_run import mean, print_footer, print_table, run_column, run_columns  # bench/, beside this script

REPO = Path(__file__).resolve().parent.parent
CONFIG = REPO / "configs" / "text_grpo.yaml"
BASELINE = "full"
COLUMNS = {
    "full": [],
    "lora": ["actor.lora={rank: 8, alpha: 16}", "actor.lr=1e-3"],
    "lora_base": ["actor.lora={rank: 8, alpha: 16}", "actor.lr=1e-3", "algorithm.kl.reference=lora_base"],
}
ADAM_BYTES = 8
"""AdamW's state per trained fp32 parameter: two moments of 4 bytes."""


def run(column: str, seed: int, iterations: int, quick: bool, eval_prompts: int) -> dict:
    summary, wall_s, _ = run_column(CONFIG, "lora", column, seed, iterations, quick, eval_prompts, COLUMNS[column])
    parameters = summary["actor_parameters"]
    return {"before": summary["eval_reward_before"], "after": summary["eval_reward_after"],
            "greedy_after": summary["eval_greedy_reward_after"], "trained": parameters["trained"],
            "total": parameters["total"], "iteration_s": summary["iteration_s"],
            "tokens_per_s": summary["tokens_per_s"], "wall_s": wall_s,
            "processes": summary["memory"]["processes"], "pss_mb": summary["memory"]["peak_pss_mb"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--iterations", type=int, default=None, help="default: the config's (30); --quick: 2")
    parser.add_argument("--eval-prompts", type=int, default=None, help="default 1024; --quick: 64")
    parser.add_argument("--quick", action="store_true", help="smoke run: seed 0, 2 iterations, 64 eval prompts")
    parser.add_argument("--json", action="store_true", help="also print the figures as one JSON line")
    args = parser.parse_args()
    seeds = [0] if args.quick else args.seeds
    iterations = args.iterations or (2 if args.quick else 30)
    eval_prompts = args.eval_prompts or (64 if args.quick else 1024)
    results = run_columns(list(COLUMNS), seeds,
                          lambda column, seed: run(column, seed, iterations, args.quick, eval_prompts))
    figures = {}
    for column, runs in results.items():
        after, before = mean([r["after"] for r in runs]), mean([r["before"] for r in runs])
        figures[column] = {"before": before, "after": after, "gain": round(after - before, 4),
                           "greedy_after": mean([r["greedy_after"] for r in runs]),
                           "trained": runs[0]["trained"], "total": runs[0]["total"],
                           "optimizer_mb": round(runs[0]["trained"] * ADAM_BYTES / 2**20, 3),
                           "iteration_s": mean([r["iteration_s"] for r in runs]),
                           "tokens_per_s": mean([r["tokens_per_s"] for r in runs]),
                           "processes": runs[0]["processes"], "pss_mb": mean([r["pss_mb"] for r in runs]),
                           "after_by_seed": [r["after"] for r in runs]}
    base = figures[BASELINE]
    for column in COLUMNS:
        ours = figures[column]
        ours["ratios"] = {"eval_after": round(ours["after"] / max(base["after"], 1e-9), 3),
                          "optimizer_memory": round(ours["optimizer_mb"] / max(base["optimizer_mb"], 1e-9), 3),
                          "tokens_per_s": round(ours["tokens_per_s"] / max(base["tokens_per_s"], 1e-9), 3),
                          "host_memory": round(ours["pss_mb"] / max(base["pss_mb"], 1e-9), 3)}
    rows = [("eval before", "before", "{:.3f}"), ("eval after", "after", "{:.3f}"), ("gain", "gain", "{:+.3f}"),
            ("greedy after", "greedy_after", "{:.3f}"), ("params trained", "trained", "{:,d}"),
            ("of params", "total", "{:,d}"), ("AdamW state MB", "optimizer_mb", "{:.3f}"),
            ("processes", "processes", "{:d}"), ("host PSS MB", "pss_mb", "{:.0f}"),
            ("iteration s", "iteration_s", "{:.3f}"), ("tokens/s", "tokens_per_s", "{:.0f}")]
    print_table(figures, list(COLUMNS), rows)
    for label, key in (("eval after", "eval_after"), ("AdamW state", "optimizer_memory"), ("host PSS", "host_memory"),
                       ("tokens/s", "tokens_per_s")):
        print(f"{label + ' / ' + BASELINE:18}" + "".join(f"{figures[c]['ratios'][key]:>12.2f}" for c in COLUMNS))
    print_footer(figures, BASELINE, iterations, seeds, eval_prompts, args.json)


if __name__ == "__main__":
    main()
