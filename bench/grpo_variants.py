"""GRPO as shipped against its variants (Dr. GRPO, GSPO, overlong filtering, DAPO's dynamic
sampling) on the arithmetic task.

Each column is one `stream-rlhf run configs/text_grpo.yaml` subprocess (the same warm-started tiny
model, prompts, batch shape and iteration count, so the same number of samples;
runs/bench_grpo_<column>_s<seed>/), differing only in `algorithm` keys (docs/algorithms.md):

    grpo        the config as shipped: group std, token_mean, token-level ratios
    dr_grpo     group_std=false, loss_aggregation=token_sum (the config whitens nothing already)
    gspo        ratio_level=sequence, clip_low=3e-4, clip_high=4e-4, loss_aggregation=sequence_mean
    overlong    mask_truncated=true (answers cut at rollout.max_new_tokens carry no loss)
    filter      dynamic_sampling={}: the groups whose answers all score the same train nothing
    dapo        dynamic_sampling={groups: 32} with 1.5x the prompts generated (24 a mini-batch): at
                most the baseline's 32 groups train an iteration, all informative (DAPO)
    grpo_more   the control of dapo: as many prompts generated (24 a mini-batch), every group trained

Figures per column, means over the seeds: the eval reward (sampled answers on `--eval-prompts`
held-out prompts, 1024 by default) before and after RL, its gain, the greedy eval reward after,
the samples generated and trained (the first seed's), the answers masked as cut (overlong) and the
run's wall time (`stream-rlhf run` start to end, evaluations included). The ratio is each column's eval reward
after RL over the baseline `grpo` column's. On this tiny model one seed's eval reward moves by a few
hundredths between runs: read differences below that as noise.

    .venv/bin/python bench/grpo_variants.py                   # 7 columns x seeds 0 1 (~5 minutes on 2 idle cores)
    .venv/bin/python bench/grpo_variants.py --seeds 0 --json
    .venv/bin/python bench/grpo_variants.py --quick --json    # smoke: seed 0, 2 iterations, a 40-step warm
                                                              # start, 64 eval prompts
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from job_run import mean, print_footer, print_table, run_column, run_columns  # bench/, beside this script

REPO = Path(__file__).resolve().parent.parent
CONFIG = REPO / "configs" / "text_grpo.yaml"
BASELINE = "grpo"
COLUMNS = {
    "grpo": [],
    "dr_grpo": ["algorithm.group_std=false", "algorithm.loss_aggregation=token_sum"],
    "gspo": ["algorithm.ratio_level=sequence", "algorithm.clip_low=3e-4", "algorithm.clip_high=4e-4",
             "algorithm.loss_aggregation=sequence_mean"],
    "overlong": ["algorithm.mask_truncated=true"],
    "filter": ["algorithm.dynamic_sampling={}"],
    "dapo": ["rollout_batch.prompts_per_minibatch=24", "algorithm.dynamic_sampling={groups: 32}"],
    "grpo_more": ["rollout_batch.prompts_per_minibatch=24"],
}


def run(column: str, seed: int, iterations: int, quick: bool, eval_prompts: int) -> dict:
    summary, wall_s, name = run_column(CONFIG, "grpo", column, seed, iterations, quick, eval_prompts, COLUMNS[column])
    metrics = (REPO / "runs" / name / "metrics.jsonl").read_text().splitlines()
    return {"before": summary["eval_reward_before"], "after": summary["eval_reward_after"],
            "greedy_after": summary["eval_greedy_reward_after"], "samples": summary["samples_trained"],
            "generated": summary["samples_generated"],
            "masked_truncated": sum(json.loads(line).get("samples_masked_truncated", 0) for line in metrics),
            "wall_s": wall_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--iterations", type=int, default=None, help="default: the config's (30); --quick: 2")
    parser.add_argument("--eval-prompts", type=int, default=None, help="default 1024; --quick: 64")
    parser.add_argument("--columns", nargs="+", choices=list(COLUMNS), default=list(COLUMNS))
    parser.add_argument("--quick", action="store_true", help="smoke run: seed 0, 2 iterations, 64 eval prompts")
    parser.add_argument("--json", action="store_true", help="also print the figures as one JSON line")
    args = parser.parse_args()
    seeds = [0] if args.quick else args.seeds
    iterations = args.iterations or (2 if args.quick else 30)
    eval_prompts = args.eval_prompts or (64 if args.quick else 1024)
    columns = [BASELINE, *(c for c in args.columns if c != BASELINE)]
    results = run_columns(columns, seeds,
                          lambda column, seed: run(column, seed, iterations, args.quick, eval_prompts))
    figures = {}
    for column, runs in results.items():
        after = mean([r["after"] for r in runs])
        before = mean([r["before"] for r in runs])
        figures[column] = {"before": before, "after": after, "gain": round(after - before, 4),
                           "greedy_after": mean([r["greedy_after"] for r in runs]),
                           "generated": runs[0]["generated"], "samples": runs[0]["samples"],
                           "masked_truncated": sum(r["masked_truncated"] for r in runs),
                           "wall_s": mean([r["wall_s"] for r in runs]),
                           "after_by_seed": [r["after"] for r in runs]}
    baseline = figures[BASELINE]["after"]
    rows = [("eval before", "before", "{:.3f}"), ("eval after", "after", "{:.3f}"), ("gain", "gain", "{:+.3f}"),
            ("greedy after", "greedy_after", "{:.3f}"), ("samples generated", "generated", "{:d}"),
            ("samples trained", "samples", "{:d}"),
            ("masked as cut", "masked_truncated", "{:d}"), ("wall s", "wall_s", "{:.1f}")]
    print_table(figures, columns, rows)
    print(f"{'after / ' + BASELINE:18}" + "".join(f"{figures[c]['after'] / max(baseline, 1e-9):>12.2f}"
                                               for c in columns))
    print_footer(figures, BASELINE, iterations, seeds, eval_prompts, args.json)


if __name__ == "__main__":
    main()
