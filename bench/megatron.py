"""Megatron benchmark: actor training on the megatron engine against the torch engine, same model
and data, side by side; and the bytes a context-parallel log-prob gather moves.

One PPO optimizer step after another (`train_step` with the project's policy loss, the fused
log-prob kernel, AdamW, gradient clipping) on bench/scaling.py's Qwen2 (~12M parameters; `--quick`:
a 1-layer hidden-128 one), fed the same synthetic samples in every column:

    torch 1 rank          the baseline: TorchTrainEngine, one process on one core
    megatron 1 rank       MegatronTrainEngine, tp 1 (megatron's GPTModel, DDP, FP32Optimizer on CPU)
    torch 2 ranks         FSDP2 over gloo, one core per rank, each step's samples split
    megatron tp 2         tensor parallel over gloo, one core per rank, every rank on every sample
    megatron pp 2         two pipeline stages (half the layers each), the step as one micro-batch:
                          one stage waits while the other computes
    megatron pp 2 micro   the same in micro-batches of `--micro-tokens` (1F1B: the stages overlap)

Each column reports tokens/s (every sequence token of the timed steps, on rank 0, after a warm-up
step; best of `--repeats`) and peak resident memory (the largest rank's `ru_maxrss`, MiB; on a
CPU that includes each process's Python, torch and megatron imports). Ratios are megatron / torch
at the same rank count, and pp 2 in micro-batches / pp 2 in one. The CP figures compare what
`kernels/cp_gather.py` all-gathers per step (B x S fp32 log-probs) with gathering the hidden states
(B x S x H): the ratio is H.

Run from the repository root:

    .venv/bin/python bench/megatron.py            # ~12M params, 64 samples x 128 tokens (a few minutes)
    .venv/bin/python bench/megatron.py --quick    # a smoke run
    .venv/bin/python bench/megatron.py --json     # the table, then one JSON object as the last line

JSON: params, tokens_per_step, cores, micro_batch_tokens, `<column>_tokens_per_s` and
`<column>_peak_mib` for torch_1rank, megatron_1rank, torch_2ranks, megatron_tp2, megatron_pp2,
megatron_pp2_micro; ratio_1rank, ratio_2ranks, ratio_pp2_micro, cp_logprob_gather_bytes,
cp_hidden_gather_bytes, cp_ratio, hidden.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import multiprocessing as mp
import os
import resource
import sys
import tempfile
import time

BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != BENCH]  # this file would shadow megatron-core

import torch  # noqa: E402

from stream_rlhf.algos.losses import policy_loss  # noqa: E402
from stream_rlhf.backends.optimizer_config import OptimizerConfig  # noqa: E402
from stream_rlhf.backends.torch_engine import TorchTrainEngine  # noqa: E402
from stream_rlhf.distributed import RankGroup, RankSpec  # noqa: E402
from stream_rlhf.experience import Experience  # noqa: E402
from stream_rlhf.samples import response_slices  # noqa: E402

_spec = importlib.util.spec_from_file_location("bench_scaling", os.path.join(BENCH, "scaling.py"))
scaling = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(scaling)  # bench/scaling.py: the same model and data
FULL, QUICK, build_model, samples = scaling.FULL, scaling.QUICK, scaling.build_model, scaling.samples

COLUMNS = (("torch_1rank", "torch", 1, "tp", False), ("megatron_1rank", "megatron", 1, "tp", False),
           ("torch_2ranks", "torch", 2, "tp", False), ("megatron_tp2", "megatron", 2, "tp", False),
           ("megatron_pp2", "megatron", 2, "pp", False), ("megatron_pp2_micro", "megatron", 2, "pp", True))
"""(name, backend, ranks, how megatron splits its ranks: "tp" or "pp", micro-batches)."""
MICRO_TOKENS = 1024
"""`--micro-tokens`' default: 8 micro-batches of a full step (64 samples x 128 tokens)."""


def build_engine(backend: str, group: RankGroup, size: dict[str, int], split: str, micro_tokens: int | None):
    optimizer = OptimizerConfig(lr=1e-5, micro_batch_tokens=micro_tokens)
    if backend == "torch":
        return TorchTrainEngine(build_model(size), group, optimizer)
    from stream_rlhf.backends.megatron.config import MegatronConfig
    from stream_rlhf.backends.megatron.engine import MegatronTrainEngine

    return MegatronTrainEngine(build_model(size), group, optimizer, MegatronConfig(**{split: group.world_size}))


def rank_main(rank: int, ranks: int, backend: str, split: str, micro_tokens: int | None, core: int, init_file: str,
              size: dict[str, int], repeats: int, out: mp.Queue) -> None:
    os.sched_setaffinity(0, [core])
    torch.set_num_threads(1)
    group = RankGroup.join(RankSpec(rank, ranks, f"file://{init_file}" if ranks > 1 else None))
    engine = build_engine(backend, group, size, split, micro_tokens)
    exp = samples(size)
    advantages = torch.randn(exp.mask.shape, generator=torch.Generator().manual_seed(2))

    def loss_fn(part: Experience, per_sample: dict[str, torch.Tensor]):
        logp, _ = engine.logprobs(part.sequences, 1.0)
        logp = part.padded(response_slices(logp, part.prompt_lens))
        return policy_loss(logp, part.old_logp, per_sample["advantages"], part.mask, 0.2, 0.2)

    engine.train_step(exp, loss_fn, {"advantages": advantages})  # warm-up
    best = float("inf")
    for _ in range(repeats):
        group.barrier()
        started = time.perf_counter()
        for _ in range(size["steps"]):
            engine.train_step(exp, loss_fn, {"advantages": advantages})
        best = min(best, time.perf_counter() - started)
    peak = group.max([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024])[0]
    if group.is_leader:
        out.put((size["steps"] * exp.num_tokens / best, peak))
    group.close()
    out.close()
    out.join_thread()  # the figures are in the pipe...
    os._exit(0)  # ...and no interpreter teardown of the gloo groups


def measure(backend: str, ranks: int, split: str, micro_tokens: int | None, size: dict[str, int],
            repeats: int) -> tuple[float, float]:
    """(tokens/s, peak MiB) of one column, its ranks in fresh processes, one core each."""
    cores = sorted(os.sched_getaffinity(0))
    with tempfile.TemporaryDirectory(prefix="srlhf-megatron-") as folder:
        rank_args = [(rank, ranks, backend, split, micro_tokens, cores[rank % len(cores)],
                      os.path.join(folder, "init"), size, repeats) for rank in range(ranks)]
        return scaling.spawn_ranks(rank_main, rank_args, f"{backend} x {ranks} rank(s)")


def cp_bytes(size: dict[str, int], cp: int = 2) -> tuple[int, int]:
    """Bytes every rank receives from one CP all-gather of a step's log-probs, and of its hidden
    states, for the step's B x S tokens split over `cp` ranks."""
    local = size["length"] // cp
    logp = torch.empty(size["samples"], local, dtype=torch.float32)  # (B, S / cp): what cp_gather moves
    hidden = torch.empty(size["samples"], local, size["hidden"], dtype=torch.float32)  # (B, S / cp, H)
    return cp * logp.nbytes, cp * hidden.nbytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a tiny model: a smoke run")
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs per column (best is kept)")
    parser.add_argument("--micro-tokens", type=int, default=None,
                        help=f"micro_batch_tokens of the pp 2 micro column (default {MICRO_TOKENS}; --quick: 128)")
    args = parser.parse_args()
    size = {**(QUICK if args.quick else FULL), "steps": 2}
    size["layers"] = max(size["layers"], 2)  # pp 2 splits them
    micro_tokens = args.micro_tokens or (128 if args.quick else MICRO_TOKENS)
    repeats = args.repeats or (1 if args.quick else 2)
    cores = len(os.sched_getaffinity(0))
    if cores < 2:
        sys.exit(f"bench/megatron.py: needs two cores (this process may use {sorted(os.sched_getaffinity(0))})")
    params = sum(p.numel() for p in build_model(size).parameters())
    print(f"actor training, Qwen2 {params / 1e6:.1f}M params, {size['samples']} samples x {size['length']} tokens "
          f"per step, {size['steps']} steps x best of {repeats}, cpu, {cores} cores", flush=True)
    result: dict[str, float | int] = {"params": params, "tokens_per_step": size["samples"] * size["length"],
                                      "cores": cores, "micro_batch_tokens": micro_tokens}
    for name, backend, ranks, split, micro in COLUMNS:
        tokens_per_s, peak = measure(backend, ranks, split, micro_tokens if micro else None, size, repeats)
        result[f"{name}_tokens_per_s"], result[f"{name}_peak_mib"] = round(tokens_per_s, 1), round(peak, 1)
        print(f"  {name.replace('_', ' '):16s} {tokens_per_s:10.0f} tokens/s  {peak:8.0f} MiB peak", flush=True)
    result["ratio_1rank"] = round(result["megatron_1rank_tokens_per_s"] / result["torch_1rank_tokens_per_s"], 3)
    result["ratio_2ranks"] = round(result["megatron_tp2_tokens_per_s"] / result["torch_2ranks_tokens_per_s"], 3)
    result["ratio_pp2_micro"] = round(result["megatron_pp2_micro_tokens_per_s"]
                                      / result["megatron_pp2_tokens_per_s"], 3)
    logp_bytes, hidden_bytes = cp_bytes(size)
    result.update(cp_logprob_gather_bytes=logp_bytes, cp_hidden_gather_bytes=hidden_bytes,
                  cp_ratio=hidden_bytes / logp_bytes, hidden=size["hidden"])
    print(f"megatron / torch: {result['ratio_1rank']:.2f}x at 1 rank, {result['ratio_2ranks']:.2f}x at 2 ranks "
          f"(tp 2 against FSDP2); pp 2 in micro-batches of {micro_tokens} tokens / in one: "
          f"{result['ratio_pp2_micro']:.2f}x; CP=2 gather per step: {logp_bytes} bytes of log-probs against "
          f"{hidden_bytes} of hidden states ({result['cp_ratio']:.0f}x = H)")
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
