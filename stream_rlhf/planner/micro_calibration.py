"""This machine's device figures, timed in a few seconds on the job's model shape (no run needed).

    device = this_machine(shape, work, threads=1, cache_dir=Path("runs/.cache"))   # DeviceFigures

What is timed, in fp32 with `threads` torch threads (a stage's rank runs with its cores' count):

    peak           a matmul of a mini-batch's tokens x hidden by hidden x intermediate (FLOP/s)
    bandwidth      copying a 64 MB tensor (bytes read + written / s)
    rate, overhead the forward stages' log-probs (`TorchTrainEngine.forward_logprobs`) of a random
                   model of the job's shape over the rows of a training pass (or a mini-batch,
                   the more) and over one row: a forward lasts fixed + tokens x
                   per-token, so the two give the rate (2 P / per-token; efficiency: rate / peak)
                   and the fixed part (per layer + 1)
    decode         a step of the rollout engine's sampler (`backends/torch_rollout.py`, the rows
                   of a mini-batch, sampling included: 17 new tokens less 1): what it took beyond
                   its FLOPs at the rate or its weights at `bandwidth` (the larger), per layer + 1

Every figure is the fastest of a few repeats (the machine is shared: the fastest is the least
disturbed). The figures are kept in `cache_dir/planner_machine_<key>.json`, the key covering this
host, its CPU, torch's version, the threads and the shapes timed, so a later plan reads them.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import platform
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch

from stream_rlhf.atomic_file import write_text_atomically
from stream_rlhf.backends.torch_engine import TorchTrainEngine
from stream_rlhf.backends.torch_rollout import SamplingParams, generate
from stream_rlhf.distributed import RankGroup
from stream_rlhf.planner.analytic import ModelShape, Workload
from stream_rlhf.planner.devices import DeviceFigures

log = logging.getLogger(__name__)
REPEATS = 9
COPY_FLOATS = 16 * 2**20
"""64 MB of fp32: larger than the caches, small enough to time in milliseconds."""
DECODE_STEPS = 16
"""Decode steps timed (as the difference of two generations)."""
MAX_TIMED_LAYERS = 2
"""The model timed keeps at most this many layers (overheads are per layer)."""


def this_machine(shape: ModelShape, work: Workload, threads: int, cache_dir: Path) -> DeviceFigures:
    """The figures of this machine for `shape` and `work` (cached; module docstring)."""
    key = {"host": platform.node(), "cpu": _cpu_model(), "torch": torch.__version__, "threads": threads,
           "shape": asdict(shape), "work": asdict(work)}  # what `measure` times depends on all of it
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    path = cache_dir / f"planner_machine_{digest}.json"
    if path.is_file():
        return DeviceFigures(**json.loads(path.read_text())["figures"])
    started = time.perf_counter()
    figures = measure(shape, work, threads)
    log.info("plan: timed this machine in %.1f s: %s", time.perf_counter() - started, figures.describe())
    write_text_atomically(path, json.dumps({"key": key, "figures": asdict(figures)}, indent=1))
    return figures


def measure(shape: ModelShape, work: Workload, threads: int) -> DeviceFigures:
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with warnings.catch_warnings():  # transformers' notes on its cache arguments
            warnings.simplefilter("ignore")
            return _measure(shape, work, threads)
    finally:
        torch.set_num_threads(previous)


def _measure(shape: ModelShape, work: Workload, threads: int) -> DeviceFigures:
    tokens = max(1, round(work.tokens))
    x, weight = torch.randn(tokens, shape.hidden), torch.randn(shape.hidden, shape.intermediate)
    peak = 2 * tokens * shape.hidden * shape.intermediate / fastest(lambda: torch.mm(x, weight))
    source, target = torch.randn(COPY_FLOATS), torch.empty(COPY_FLOATS)
    bandwidth = 2 * 4 * COPY_FLOATS / fastest(lambda: target.copy_(source))
    timed = ModelShape(**{**asdict(shape), "layers": min(shape.layers, MAX_TIMED_LAYERS)})
    model = _random_model(timed)
    seq = max(1, round(work.prompt_tokens + work.response_tokens))
    rows = max(work.rows, math.ceil(work.rows * work.minibatches / work.train_minibatches), 2)  # a training pass's
    ids = torch.randint(0, timed.vocab, (rows, seq))
    prompts = list(ids[:work.rows, :max(1, round(work.prompt_tokens))])
    engine = TorchTrainEngine(model, RankGroup.single())  # the forward stages' own: packing, log-probs
    large = fastest(lambda: engine.forward_logprobs(list(ids), temperature=1.0))
    small = fastest(lambda: engine.forward_logprobs(list(ids[:1]), temperature=1.0))
    with torch.inference_mode():
        # the rollout engine's own sampler: DECODE_STEPS more steps, sampling included
        long, short = (fastest(lambda n=n: generate(model, prompts, SamplingParams(max_new_tokens=n)))
                       for n in (1 + DECODE_STEPS, 1))
    decode = max(long - short, 0.0) / DECODE_STEPS
    # a forward lasts fixed + tokens x per_token: two sizes give both
    per_token = max(large - small, 1e-12) / ((rows - 1) * seq)
    fixed = max(0.0, small - seq * per_token)
    layers = timed.layers + 1
    rate = 2 * timed.params / per_token
    step = max(2 * timed.params * work.rows / rate, 4 * timed.params / bandwidth)
    return DeviceFigures(name=f"this machine ({_cpu_model()}, {threads} thread(s), measured)", peak_flops=peak,
                         efficiency=min(1.0, rate / peak), bandwidth=bandwidth, layer_overhead_s=fixed / layers,
                         decode_overhead_s=max(0.0, decode - step) / layers, bytes_per_param=4,
                         link_bandwidth=bandwidth, host_bandwidth=bandwidth, memory_gb=_host_memory_gb())


def fastest(work: Callable[[], object]) -> float:
    """The fastest of REPEATS timings of `work`, after one untimed call (warm-up)."""
    work()
    times = []
    for _ in range(REPEATS):
        started = time.perf_counter()
        work()
        times.append(time.perf_counter() - started)
    return min(times)


def _random_model(shape: ModelShape) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
                         num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
                         num_key_value_heads=shape.kv_heads, head_dim=shape.head_dim, tie_word_embeddings=shape.tied)
    return Qwen2ForCausalLM(config).eval()


def _cpu_model() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or "cpu"
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "cpu")


def _host_memory_gb() -> float:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
