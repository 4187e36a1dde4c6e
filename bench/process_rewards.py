"""Outcome-only rewards against outcome + process rewards on the multi-step arithmetic task.

Each column is one `stream-rlhf run configs/text_ppo_steps.yaml` subprocess (PPO with GAE, the
same warm-started tiny model, prompts, batch shape, iteration count and so the same number of
samples; runs/bench_prm_<column>_s<seed>/), differing only in `reward.process`:

    outcome     reward.process=null: the last number's reward on the last token, nothing else
    rule_prm    + 0.5 x stream_rlhf.data.arithmetic:step_reward (1 per right partial sum) at the
                token ending each step (the config as shipped)
    model_prm   + 0.5 x a tiny PRM's sigmoid score per step, the PRM trained first from the warm
                start on corrupted multi-step answers (`stream_rlhf.models.prm`, cached in
                runs/.cache/prm-<warm start>-<steps>/; its held-out step accuracy is printed)

Figures per column, means over the seeds: the eval reward (the outcome reward of sampled answers
on `--eval-prompts` held-out prompts, 1024 by default, the quantity both settings are judged by)
before and after RL, its gain, the greedy eval reward after, and the samples trained. The ratio
is each column's eval reward after RL over the baseline `outcome` column's.

    .venv/bin/python bench/process_rewards.py                  # 3 columns x seeds 0 1 (~10 minutes on 2 idle cores)
    .venv/bin/python bench/process_rewards.py --seeds 0 --iterations 10 --json
    .venv/bin/python bench/process_rewards.py --quick --json   # smoke: seed 0, 2 iterations, a 40-step
                                                               # warm start, 64 eval prompts, no model_prm
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from job_run import run_job  # bench/, beside this script

REPO = Path(__file__).resolve().parent.parent
CONFIG = REPO / "configs" / "text_ppo_steps.yaml"
BASELINE = "outcome"
COLUMNS = ("outcome", "rule_prm", "model_prm")
PRM_STEPS = 400


def prm_folder(iterations: int) -> tuple[Path, float]:
    """The tiny PRM trained from this config's warm start (trained once, then cached), and its
    held-out step accuracy."""
    sys.path.insert(0, str(REPO))
    from stream_rlhf.config import load_config
    from stream_rlhf.driver.warm_start import warm_start
    from stream_rlhf.models.prm import train_tiny_prm
    from stream_rlhf.rl.config import RLJobConfig

    cfg = load_config(RLJobConfig, CONFIG, [f"iterations={iterations}"])
    policy = warm_start(cfg)
    folder = REPO / "runs" / ".cache" / f"prm-{policy.name}-{PRM_STEPS}"
    if (folder / "prm.json").is_file():
        return folder, json.loads((folder / "prm.json").read_text())["step_accuracy"]
    result = train_tiny_prm(folder, policy, PRM_STEPS, max_operand=cfg.task.max_operand, terms=cfg.task.terms)
    return folder, result["step_accuracy"]


def run(column: str, seed: int, iterations: int, prm: Path | None, quick: bool, eval_prompts: int) -> dict:
    name = f"bench_prm_{column}_s{seed}" + ("_quick" if quick else "")
    sets = [f"seed={seed}", f"iterations={iterations}", f"broker.shm_prefix=b_prm_{column}_{seed}",
            f"task.eval_prompts={eval_prompts}"]
    if quick:  # a 40-step warm start of its own (seconds)
        sets.append("model.warm_start.steps=40")
    if column == "outcome":
        sets.append("reward.process=null")
    elif column == "model_prm":
        sets.append(f"reward.process={{model_path: {prm}, separator: ',', weight: 0.5}}")
    summary, wall_s = run_job(CONFIG, name, sets, f"{column} seed {seed}")
    return {"before": summary["eval_reward_before"], "after": summary["eval_reward_after"],
            "greedy_after": summary["eval_greedy_reward_after"], "samples": summary["samples_trained"],
            "wall_s": wall_s}


def mean(rows: list[dict], key: str) -> float:
    return round(sum(r[key] for r in rows) / len(rows), 4)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--iterations", type=int, default=30)
    parser.add_argument("--columns", nargs="+", choices=COLUMNS, default=list(COLUMNS))
    parser.add_argument("--eval-prompts", type=int, default=1024,
                        help="held-out prompts of each evaluation (256: one standard error is about 0.03 here)")
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run: seed 0, 2 iterations, a 40-step warm start, 64 eval prompts, outcome "
                             "and rule_prm")
    parser.add_argument("--json", action="store_true", help="end with one JSON line of the figures")
    args = parser.parse_args()
    if args.quick:
        args.seeds, args.iterations, args.columns, args.eval_prompts = [0], 2, ["outcome", "rule_prm"], 64
    logging.basicConfig(level=logging.INFO, format="%(asctime)s bench %(message)s")
    prm, accuracy = prm_folder(args.iterations) if "model_prm" in args.columns else (None, None)
    if accuracy is not None:
        print(f"tiny PRM ({PRM_STEPS} steps) in {prm}: step accuracy {accuracy:.3f} on held-out answers")
    results = {}
    for column in args.columns:
        rows = []
        for seed in args.seeds:
            rows.append(run(column, seed, args.iterations, prm, args.quick, args.eval_prompts))
            print(f"{column} seed {seed}: {rows[-1]}", flush=True)
        results[column] = {key: mean(rows, key) for key in ("before", "after", "greedy_after", "samples", "wall_s")}
        results[column]["gain"] = round(results[column]["after"] - results[column]["before"], 4)
        results[column]["per_seed_after"] = [r["after"] for r in rows]
    base = results.get(BASELINE, {}).get("after")
    print(f"\n{'column':<10} {'eval before':>11} {'eval after':>10} {'gain':>7} {'greedy after':>12} "
          f"{'samples':>8} {'after / outcome':>15}")
    for column, r in results.items():
        ratio = f"{r['after'] / base:.2f}x" if base else "-"
        print(f"{column:<10} {r['before']:>11.3f} {r['after']:>10.3f} {r['gain']:>+7.3f} {r['greedy_after']:>12.3f} "
              f"{r['samples']:>8.0f} {ratio:>15}")
    if args.json:
        print(json.dumps({"baseline": BASELINE, "seeds": args.seeds, "iterations": args.iterations,
                          "prm_step_accuracy": accuracy, "columns": results}))


if __name__ == "__main__":
    main()
