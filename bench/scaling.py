"""Scaling benchmark: actor training throughput of one rank against a stage group of two ranks.

One PPO optimizer step after another (`TorchTrainEngine.train_step` with the project's policy
loss, the fused log-prob kernel, AdamW, gradient clipping) on a Qwen2 of ~12M parameters (hidden
512, 4 layers: compute dominates), fed the same synthetic samples in every column, side by side:

    1 rank x 1 thread    the baseline: one process on one core
    1 rank x 2 threads   one process, torch's intra-op threads on both cores
    2 ranks x 1 thread   a stage group: FSDP2 over gloo, one core per rank, each step's samples
                         split over the ranks (what `placement.stages.actor_train.ranks: 2` runs)

Tokens/s counts every sequence token of the steps (prompt + response), timed on rank 0 after a
warm-up step; the best of `--repeats` timed runs of `--steps` steps. `ratio_2ranks` is 2 ranks /
1 rank x 1 thread (target >= 1.6), `ratio_2ranks_vs_threads` 2 ranks / 1 rank x 2 threads (target
>= 1.0). With `--device cuda` (and at least two GPUs for the group) the columns run on GPUs.

Run from the repository root:

    .venv/bin/python bench/scaling.py            # ~12M params, 64 samples of 128 tokens per step (~2 min)
    .venv/bin/python bench/scaling.py --quick    # a 1-layer hidden-128 model (a smoke run, ~20 s)
    .venv/bin/python bench/scaling.py --json     # the table, then one JSON object as the last line

JSON: params, device, tokens_per_step, cores, and for each column `<column>_tokens_per_s`
(one_rank_one_thread, one_rank_two_threads, two_ranks_one_thread), ratio_2ranks,
ratio_2ranks_vs_threads, ratio_threads.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import tempfile
import time

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from stream_rlhf.algos.losses import policy_loss
from stream_rlhf.backends.optimizer_config import OptimizerConfig
from stream_rlhf.backends.torch_engine import TorchTrainEngine
from stream_rlhf.distributed import RankGroup, RankSpec
from stream_rlhf.experience import Experience
from stream_rlhf.samples import response_slices

VOCAB = 128
FULL = {"hidden": 512, "intermediate": 1376, "layers": 4, "heads": 8, "samples": 64, "length": 128, "steps": 3}
QUICK = {"hidden": 128, "intermediate": 256, "layers": 1, "heads": 2, "samples": 16, "length": 32, "steps": 2}
COLUMNS = (("one_rank_one_thread", 1, 1), ("one_rank_two_threads", 1, 2), ("two_ranks_one_thread", 2, 1))


def build_model(size: dict[str, int]) -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(
        vocab_size=VOCAB, hidden_size=size["hidden"], intermediate_size=size["intermediate"],
        num_hidden_layers=size["layers"], num_attention_heads=size["heads"], num_key_value_heads=size["heads"],
        head_dim=size["hidden"] // size["heads"], max_position_embeddings=size["length"], tie_word_embeddings=True,
    ))


def samples(size: dict[str, int]) -> Experience:
    """`samples` sequences of `length` tokens, half prompt and half response."""
    g = torch.Generator().manual_seed(1)
    n, length = size["samples"], size["length"]
    response = length // 2
    mask = torch.ones(n, response)
    behavior = -torch.rand(n, response, generator=g)
    return Experience(sequences=list(torch.randint(1, VOCAB, (n, length), generator=g)),
                      prompt_lens=torch.full((n,), length - response), mask=mask, behavior_logp=behavior,
                      old_logp=behavior.clone(), ref_logp=behavior.clone(), values=None, scores=torch.zeros(n),
                      group_ids=torch.arange(n), policy_versions=torch.zeros(n))


def rank_main(rank: int, ranks: int, threads: int, cores: list[int], device: str, init_file: str,
              size: dict[str, int], repeats: int, out: mp.Queue) -> None:
    os.sched_setaffinity(0, cores)
    torch.set_num_threads(threads)
    group = RankGroup.join(RankSpec(rank, ranks, f"file://{init_file}" if ranks > 1 else None, device))
    try:
        engine = TorchTrainEngine(build_model(size), group, OptimizerConfig(lr=1e-5))
        exp = samples(size)
        advantages = torch.randn(exp.mask.shape, generator=torch.Generator().manual_seed(2))

        def loss_fn(part: Experience, per_sample: dict[str, torch.Tensor]):
            logp, _ = engine.logprobs(part.sequences, 1.0)
            logp = part.padded(response_slices(logp, part.prompt_lens))
            return policy_loss(logp, part.old_logp, per_sample["advantages"], part.mask, 0.2, 0.2)

        def step() -> None:
            engine.train_step(exp, loss_fn, {"advantages": advantages})

        step()  # warm-up: allocations, FSDP2's lazy init
        best = float("inf")
        for _ in range(repeats):
            group.barrier()
            _synchronize(engine.device)
            started = time.perf_counter()
            for _ in range(size["steps"]):
                step()
            _synchronize(engine.device)
            best = min(best, time.perf_counter() - started)
        if group.is_leader:
            out.put(size["steps"] * exp.num_tokens / best)
    finally:
        group.close()
    out.close()
    out.join_thread()  # the figure is in the pipe...
    os._exit(0)  # ...and no interpreter teardown: it aborts now and then once FSDP2 ran over gloo


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def spawn_ranks(target, rank_args: list[tuple], label: str):
    """`target(*rank_args[r], out)` for every rank r in fresh spawned processes; what rank 0 put in
    `out` (bench/megatron.py runs its columns through this too)."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=target, args=(*args, out)) for args in rank_args]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    failed = [p.exitcode for p in procs if p.exitcode != 0]
    if failed:
        raise RuntimeError(f"{label}: a rank exited with {failed}")
    return out.get(timeout=10)


def measure(ranks: int, threads: int, device: str, size: dict[str, int], repeats: int) -> float:
    """Tokens/s of one column, its ranks in fresh processes."""
    cores = sorted(os.sched_getaffinity(0))
    with tempfile.TemporaryDirectory(prefix="srlhf-scaling-") as folder:
        rank_args = [(rank, ranks, threads, cores[rank * threads:(rank + 1) * threads] if device == "cpu" else cores,
                      f"cuda:{rank}" if device == "cuda" else "cpu", os.path.join(folder, "init"), size, repeats)
                     for rank in range(ranks)]
        return spawn_ranks(rank_main, rank_args, f"{ranks} rank(s) x {threads} thread(s)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a tiny model: a smoke run")
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs per column (best is kept)")
    args = parser.parse_args()
    size = QUICK if args.quick else FULL
    repeats = args.repeats or (1 if args.quick else 3)
    cores = len(os.sched_getaffinity(0))
    if args.device == "cpu" and cores < 2:
        sys.exit("bench/scaling.py: needs two cores (this process may use "
                 f"{sorted(os.sched_getaffinity(0))})")
    if args.device == "cuda" and torch.cuda.device_count() < 2:
        sys.exit(f"bench/scaling.py --device cuda: needs two GPUs for the group ({torch.cuda.device_count()} here)")
    params = sum(p.numel() for p in build_model(size).parameters())
    tokens_per_step = size["samples"] * size["length"]
    print(f"actor training, Qwen2 {params / 1e6:.1f}M params, {size['samples']} samples x {size['length']} tokens "
          f"per step, {size['steps']} steps x best of {repeats}, device {args.device}, {cores} cores", flush=True)
    figures: dict[str, float] = {}
    for name, ranks, threads in COLUMNS:
        figures[name] = measure(ranks, threads, args.device, size, repeats)
        print(f"  {name.replace('_', ' '):24s} {figures[name]:10.0f} tokens/s", flush=True)
    base, threads2, ranks2 = (figures[name] for name, _, _ in COLUMNS)
    result = {
        "params": params, "device": args.device, "tokens_per_step": tokens_per_step, "cores": cores,
        **{f"{name}_tokens_per_s": round(value, 1) for name, value in figures.items()},
        "ratio_2ranks": round(ranks2 / base, 3),
        "ratio_2ranks_vs_threads": round(ranks2 / threads2, 3),
        "ratio_threads": round(threads2 / base, 3),
    }
    print(f"2 ranks / 1 rank x 1 thread: {result['ratio_2ranks']:.2f}x (target >= 1.6); "
          f"2 ranks / 1 rank x 2 threads: {result['ratio_2ranks_vs_threads']:.2f}x (target >= 1.0); "
          f"2 threads / 1 thread: {result['ratio_threads']:.2f}x")
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
