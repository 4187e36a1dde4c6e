"""Medusa benchmark: rollout of the default text workload with plain decoding, with stale heads and
with companion-trained heads, side by side.

1. One `stream-rlhf run configs/text_ppo.yaml` with `rollout.medusa.enabled=true` (name
   bench_medusa): the warm start trains the heads on the starting policy (kept in the warm-start
   folder), and the `medusa_train` stage fine-tunes them on every iteration's rollouts while PPO
   moves the policy; the final heads are saved in runs/bench_medusa/checkpoint/.
2. On the final policy, the same prompt mini-batches (the task's eval split) are generated three
   ways with the config's sampling (temperature 1, `rollout.max_new_tokens`), in one process:

    plain       `backends/torch_rollout.generate`, one token per forward
    stale       speculative with the heads of the warm start (frozen at the start of RL)
    companion   speculative with the companion-trained heads

Figures, for the config's mini-batch size (64 prompts) and for mini-batches of 4: tokens/s
(response tokens / wall time of the generation calls, after one untimed warm-up mini-batch; the
fastest of PASSES interleaved passes),
accept len (mean response tokens per verification step per row: 1 = every draft
rejected, heads + 1 = all accepted), backbone forwards per mini-batch (the prefill included: rows
decode in lock-step, so the slowest row sets it), and the ratios against plain decoding. Speculative decoding
is lossless (tests/test_speculative.py), so the three columns sample the same distribution.

The bound lines say what speculation can give on this machine at all: one backbone forward over
the mini-batch's rows costs t(1) for one new position and t(K+1) for a verification of K drafts.
If drafting and the acceptance test cost nothing and rows never waited for each other, heads that
emit A tokens per verification step would be at most A t(1) / t(K+1) times faster: the ceiling
is that with every draft accepted (A = K+1), the bound that with the companion heads' accept len,
and the target needs A >= 1.5 t(K+1) / t(1). On a compute-bound CPU t(K+1) / t(1) is large and the
ceiling near 1; on a memory-bound GPU the ratio is near 1 and the ceiling near K+1.

    .venv/bin/python bench/medusa.py            # the training run (~3 min) and the table
    .venv/bin/python bench/medusa.py --quick    # smoke run: 3 RL iterations, 20-step warm starts, 2 mini-batches
    .venv/bin/python bench/medusa.py --json     # the table, then one JSON object as the last line
    .venv/bin/python bench/medusa.py --device cuda   # train as above, decode and time on the GPU
    python3 bench/medusa.py --device cuda --model 358M   # Qwen2-0.5B's layer shapes, trained on the GPU too

`--model 358M` (issue 32) sets the policy to Qwen2-0.5B's layer shapes (`bench/vs_trl.py`'s
MODEL_358M); with `--device cuda` the training run's stages run on cuda:0 as well (`placement.device`).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import uuid
from pathlib import Path

import torch
from torch import nn
from transformers import DynamicCache
from vs_trl import MODEL_358M  # bench/, beside this script

from stream_rlhf.backends.kv_cache import cache_argument
from stream_rlhf.backends.speculative import generate_speculative
from stream_rlhf.backends.torch_rollout import SamplingParams, generate
from stream_rlhf.config import load_config
from stream_rlhf.data.arithmetic import problems
from stream_rlhf.data.tokenizer import load_tokenizer, stop_token_ids
from stream_rlhf.driver.warm_start import warm_start
from stream_rlhf.models.checkpoint import load_policy
from stream_rlhf.models.medusa import MedusaHeads, load_heads
from stream_rlhf.rl.config import RLJobConfig
from stream_rlhf.seeding import seeded_generator

REPO = Path(__file__).resolve().parents[1]
CONFIG = "configs/text_ppo.yaml"
NAME = "bench_medusa"
TARGETS = {"companion_accept_len": 2.0, "speedup": 1.5}
SMALL_BATCH = 4
"""A second, overhead-bound measurement: on a CPU a forward over 64 rows costs in proportion to
its tokens, so verifying K+1 positions costs about K+1 plain steps; with 4 rows a forward costs
about the same whatever its length, as decoding on a GPU does (memory-bound)."""


QUICK = ["iterations=3", "model.warm_start.steps=20", "rollout.medusa.warm_start_steps=20"]
"""--quick: a smoke run (its own warm-start cache entry, built in seconds)."""


MODELS = {"tiny": [], "358M": MODEL_358M}
"""--model: `model.tiny` overrides of the policy."""


def train(quick: bool, model: str, device: str, iterations: int) -> RLJobConfig:
    """The companion-training PPO run (`iterations` > 0: that many, else the config's); returns its config."""
    name = NAME if model == "tiny" else f"{NAME}_{model}"
    overrides = [f"name={name}", "rollout.medusa.enabled=true", f"broker.shm_prefix=bm{uuid.uuid4().hex[:6]}"]
    overrides += (QUICK if quick else []) + MODELS[model] + ([f"placement.device={device}"] if model != "tiny" else [])
    overrides += [f"iterations={iterations}"] if iterations > 0 else []
    log_path = REPO / "runs" / f"{name}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "stream_rlhf.cli", "run", CONFIG, *(f"--set={o}" for o in overrides)]
    with log_path.open("w") as log:
        code = subprocess.run(command, check=False, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                              timeout=900).returncode
    if code != 0:
        tail = "\n".join(log_path.read_text().splitlines()[-30:])
        raise RuntimeError(f"{' '.join(command)}: exit code {code}; the end of {log_path}:\n{tail}")
    return load_config(RLJobConfig, str(REPO / CONFIG), overrides)


COLUMNS = ("plain", "stale", "companion")
PASSES = 3
"""Every column decodes the mini-batches PASSES times, interleaved with the other columns mini-batch
by mini-batch (so a slow spell of a shared machine hits all three), and its fastest pass counts.
The seeds are the same in every pass, so every pass generates the same tokens."""


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work, so that the clock reads finished work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(cfg: RLJobConfig, model: nn.Module, heads: dict[str, MedusaHeads], minibatches: int,
            size: int) -> dict[str, dict[str, float]]:
    """tokens/s, accept len and forwards per mini-batch of each column over `minibatches`
    mini-batches of `size` prompts."""
    device = next(model.parameters()).device
    tokenizer = load_tokenizer(Path(cfg.run_dir) / "checkpoint")
    rollout = cfg.rollout
    params = SamplingParams(rollout.temperature, rollout.top_p, rollout.max_new_tokens,
                            stop_token_ids(tokenizer, rollout.stop), tokenizer.pad_token_id)
    prompts = [torch.tensor([tokenizer.bos_token_id, *tokenizer.encode(p.prompt, add_special_tokens=False)])
               for p in problems("eval", size * (minibatches + 1), cfg.task.seed, cfg.task.max_operand)]
    batches = [prompts[i * size:(i + 1) * size] for i in range(minibatches + 1)]
    elapsed = {column: [0.0] * PASSES for column in COLUMNS}
    counts = {column: dict.fromkeys(("tokens", "row_steps", "accepted", "forwards"), 0) for column in COLUMNS}
    for attempt in range(PASSES):
        for index, batch in enumerate(batches):
            for column in COLUMNS:
                generator = seeded_generator(cfg.seed, "bench_medusa", index, device=device)
                synchronize(device)
                started = time.perf_counter()
                with torch.inference_mode():
                    if column == "plain":
                        gen, stats = generate(model, batch, params, generator), None
                    else:
                        gen, stats = generate_speculative(model, heads[column], batch, params, generator)
                    synchronize(device)
                if index == 0:
                    continue  # warm-up
                elapsed[column][attempt] += time.perf_counter() - started
                if attempt == 0:
                    count = counts[column]
                    count["tokens"] += sum(len(r) for r in gen.response_ids)
                    if stats is None:  # the prefill samples the first token, each step one more
                        count["forwards"] += max(len(r) for r in gen.response_ids)
                    else:
                        count["row_steps"] += stats.row_steps
                        count["accepted"] += stats.drafts_accepted
                        count["forwards"] += 1 + stats.verify_steps
    return {
        column: {
            "tokens_per_s": count["tokens"] / min(elapsed[column]),
            "accept_len": 1 + count["accepted"] / count["row_steps"] if count["row_steps"] else 1.0,
            "forwards": count["forwards"] / minibatches,
        }
        for column, count in counts.items()
    }


CEILING_PROMPT = 7
"""Prompt positions in the KV cache under the timed forwards (the task's prompts have 5 to 7)."""


def forward_costs(cfg: RLJobConfig, model: nn.Module, size: int, repeats: int = 40) -> dict[str, float]:
    """t(1) and t(K+1) of the module docstring at `size` rows, in ms: the fastest of `repeats`
    forwards of `model` over 1 and over heads + 1 new positions."""
    device = next(model.parameters()).device
    prompt = torch.randint(3, model.config.vocab_size, (size, CEILING_PROMPT),
                           generator=torch.Generator().manual_seed(cfg.seed)).to(device)
    positions = cfg.rollout.medusa.heads + 1
    best = {1: float("inf"), positions: float("inf")}
    with torch.inference_mode():
        cache = DynamicCache()
        run = {**cache_argument(model, cache), "use_cache": True}
        model(prompt, **run)
        for _ in range(repeats):
            for length, fastest in best.items():
                synchronize(device)
                started = time.perf_counter()
                model(prompt[:, :length], **run)
                synchronize(device)
                best[length] = min(fastest, time.perf_counter() - started)
                cache.crop(-length)
    return {"one_ms": best[1] * 1e3, "verify_ms": best[positions] * 1e3}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run: 3 RL iterations, tiny warm starts")
    parser.add_argument("--json", action="store_true", help="end with one JSON line of the figures")
    parser.add_argument("--device", default="cpu", help="where the three columns decode (training stays on "
                        "the CPU for the tiny model)")
    parser.add_argument("--model", choices=tuple(MODELS), default="tiny", help="the policy's size")
    parser.add_argument("--iterations", type=int, default=0, help="RL iterations of the training run (default: "
                        "the config's)")
    args = parser.parse_args()
    device = torch.device(args.device)
    print("training (PPO with companion Medusa training)...", file=sys.stderr, flush=True)
    cfg = train(args.quick, args.model, args.device, args.iterations)
    checkpoint = Path(cfg.run_dir) / "checkpoint"
    model = load_policy(checkpoint).eval().to(device)
    medusa = {"stale": load_heads(warm_start(cfg)).eval().to(device),
              "companion": load_heads(checkpoint).eval().to(device)}
    torch.set_num_threads(1)  # rollout's placement: one core
    size = cfg.rollout_batch.prompts_per_minibatch
    results = measure(cfg, model, medusa, 2 if args.quick else 16, size)
    small = measure(cfg, model, medusa, 2 if args.quick else 64, SMALL_BATCH)
    scales = {size: ("", results), SMALL_BATCH: (f"_batch{SMALL_BATCH}", small)}  # rows: key suffix, table
    costs = {rows: forward_costs(cfg, model, rows) for rows in scales}
    heads = cfg.rollout.medusa.heads
    plain = results["plain"]["tokens_per_s"]
    figures = {
        "plain_tokens_per_s": round(plain, 1),
        "stale_tokens_per_s": round(results["stale"]["tokens_per_s"], 1),
        "companion_tokens_per_s": round(results["companion"]["tokens_per_s"], 1),
        "stale_accept_len": round(results["stale"]["accept_len"], 3),
        "companion_accept_len": round(results["companion"]["accept_len"], 3),
        "stale_speedup": round(results["stale"]["tokens_per_s"] / plain, 3),
        "heads": heads,
    }
    for rows, (suffix, table) in scales.items():
        figures[f"speedup{suffix}"] = round(table["companion"]["tokens_per_s"] / table["plain"]["tokens_per_s"], 3)
        step_ratio = costs[rows]["verify_ms"] / costs[rows]["one_ms"]  # t(K+1) / t(1)
        figures[f"speedup_ceiling{suffix}"] = round((heads + 1) / step_ratio, 3)
        figures[f"speedup_bound{suffix}"] = round(table["companion"]["accept_len"] / step_ratio, 3)
        figures[f"accept_len_needed{suffix}"] = round(TARGETS["speedup"] * step_ratio, 3)
    for rows, (_, table) in scales.items():
        print(f"mini-batches of {rows} prompts" + (" (the config's)" if rows == size else ""))
        print(f"{'':14}{'tokens/s':>10}{'vs plain':>10}{'accept len':>12}{'forwards/mb':>13}")
        for column in COLUMNS:
            r = table[column]
            base = table["plain"]["tokens_per_s"]
            print(f"{column:14}{r['tokens_per_s']:>10.1f}{r['tokens_per_s'] / base:>10.2f}{r['accept_len']:>12.2f}"
                  f"{r['forwards']:>13.2f}")
    for rows, (suffix, _) in scales.items():
        print(f"{rows} rows: a forward costs {costs[rows]['one_ms']:.2f} ms for 1 new position and "
              f"{costs[rows]['verify_ms']:.2f} ms for {heads + 1}; with free drafting and no lock-step, speculation "
              f"could be at most {figures['speedup_ceiling' + suffix]:.2f}x with every draft accepted and "
              f"{figures['speedup_bound' + suffix]:.2f}x with the companion heads; {TARGETS['speedup']}x needs "
              f"{figures['accept_len_needed' + suffix]:.2f} tokens per step (at most {heads + 1})")
    print("targets: " + ", ".join(f"{k} >= {v} ({'pass' if figures[k] >= v else 'miss'})" for k, v in TARGETS.items()))
    if args.json:
        print(json.dumps(figures))


if __name__ == "__main__":
    main()
