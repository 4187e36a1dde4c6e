"""Decode steps over static KV caches, one per batch and length bucket, replayed as CUDA graphs on CUDA.

    static = static_decoder("auto", device, model, log)        # None: eager decoding (`rollout.decode`)
    cache = static.cache(rows=48, positions=70, device=device)  # a SlotCache of 64 slots x 128 positions
    outputs = static.step(cache, "sample", forward, tokens, positions)   # tokens, positions: (S, Q)
    static.captures                                             # graphs captured so far (tests read it)

The launch overhead of a decode step (hundreds of small kernels, each issued from Python) is what
a CUDA graph removes: the step's kernels are recorded once and replayed with one launch. A graph
records fixed addresses and shapes, so everything a step touches is static: the slot cache
(`slot_cache.py`) of a bucket, allocated once and kept for the life of the decoder, and the step's
token and position inputs, copied into the graph's own buffers before each replay. Buckets:
slots = the batch size rounded up to a power of two, capacity = the positions a row needs rounded
up to a power of two (at least `MIN_CAPACITY`); a graph is captured per (bucket, step kind, query
length, autocast dtype) at its first use, after two warm-up runs on a side stream, and replayed
from then on. A caller whose rows move to smaller buckets as they finish (`static_sampler.compacted`)
names the query lengths its steps take (`ladder`): the first capture of a kind in a bucket then
captures it for each of them in that bucket and every smaller one of the same capacity, so that the
buckets a later, slower-finishing batch reaches are there already (a 358M Medusa run on an H200
captured slot counts 16, 4 and 1 only at iterations 2, 4 and 7). Every capture is counted in
`captures` and logged, so a test (and a trace reader) can see that steady state captures nothing
new. Sampling stays outside the graph (it draws from the caller's generator, so the tokens are the
eager sampler's for the same seed).

`torch.compile` is not used: the graphs remove the launch overhead by themselves, and compiling
each bucket would add minutes of warm-up and recompiles for no measured gain at these sizes.

Modes (`rollout.decode`): `eager` (the shrinking-batch sampler of `torch_rollout.py`, no bucket),
`static` (these caches, steps run eagerly), `graphs` (CUDA only), `auto`: graphs on CUDA,
`CPU_AUTO` on the CPU (measured: bench/decode.py, docs/backends.md). A model with
sliding-window layers decodes eagerly (the static mask is a full-attention one).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from stream_rlhf.backends.slot_cache import SlotCache
from stream_rlhf.config import ConfigError

MIN_CAPACITY = 64
"""The smallest length bucket: positions per slot."""
CPU_AUTO = "eager"
"""What `auto` means on the CPU, where no graph is captured: static measured as fast as eager within
noise (bench/decode.py), and eager drops a finished row at once."""
WARMUP_RUNS = 2
"""Runs of a step on a side stream before its capture (CUDA's lazy initialisations happen outside the graph)."""

StepForward = Callable[[SlotCache, Tensor, Tensor], tuple[Tensor, ...]]
"""(cache, tokens (S, Q), positions (S, Q)) -> the step's outputs; must not synchronise with the host."""


def slot_bucket(rows: int) -> int:
    """Slots for `rows` decoding rows: the next power of two."""
    return 1 << max(rows - 1, 0).bit_length()


def capacity_bucket(positions: int) -> int:
    """Positions per slot for rows needing `positions`: the next power of two, at least MIN_CAPACITY."""
    return max(MIN_CAPACITY, 1 << max(positions - 1, 0).bit_length())


@dataclass
class CapturedStep:
    """A step's CUDA graph and the buffers it reads and writes."""

    graph: torch.cuda.CUDAGraph
    tokens: Tensor
    positions: Tensor
    outputs: tuple[Tensor, ...]


class StaticDecoder:
    """The slot caches of one model's decoding (one per bucket, kept) and their captured steps."""

    def __init__(self, graphs: bool, log: logging.Logger | logging.LoggerAdapter | None = None):
        self.graphs = graphs
        """True: steps are captured as CUDA graphs and replayed (CUDA only)."""
        self.log = log or logging.getLogger(__name__)
        self.caches: dict[tuple[int, int], SlotCache] = {}
        self.captures = 0
        """Graphs captured so far; constant once every bucket in use has been seen."""
        self.memory_pool = torch.cuda.graph_pool_handle() if graphs else None

    @property
    def mode(self) -> str:
        """`rollout.decode`'s name of what this decoder does: static or graphs."""
        return "graphs" if self.graphs else "static"

    def cache(self, rows: int, positions: int, device: torch.device) -> SlotCache:
        """The (reset) slot cache of the bucket holding `rows` rows of `positions` positions."""
        key = (slot_bucket(rows), capacity_bucket(positions))
        cache = self.caches.get(key)
        if cache is None or cache.columns.device != device:
            cache = self.caches[key] = SlotCache(*key, device=device)
        cache.reset()
        return cache

    def step(self, cache: SlotCache, kind: str, forward: StepForward, tokens: Tensor, positions: Tensor,
             ladder: tuple[int, ...] = ()) -> tuple[Tensor, ...]:
        """One decode step of `kind` over every slot; with graphs the outputs are the graph's own
        buffers, valid until the next step. `ladder`: the query lengths the caller's steps of this
        kind take, in this bucket and the smaller ones its rows move to (see the module docstring)."""
        if not self.graphs:
            return forward(cache, tokens, positions)
        dtype = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else None
        key = (kind, tokens.shape[1], dtype)
        captured = cache.graphs.get(key)
        if captured is None:
            captured = self._add(cache, key, forward, tokens.clone(), positions.clone())
            if ladder:
                self._capture_ladder(cache, kind, dtype, forward, ladder)
        captured.tokens.copy_(tokens)
        captured.positions.copy_(positions)
        captured.graph.replay()
        return captured.outputs

    def _add(self, cache: SlotCache, key: tuple, forward: StepForward, tokens: Tensor,
             positions: Tensor) -> CapturedStep:
        """Capture the step `key` (kind, query length, autocast dtype) over `cache`, counted and logged."""
        captured = cache.graphs[key] = self._capture(cache, forward, tokens, positions)
        self.captures += 1
        self.log.info("decode graph %d captured: %s, %d slots x %d positions, %d per step",
                      self.captures, key[0], cache.slots, cache.capacity, key[1])
        return captured

    def _capture_ladder(self, cache: SlotCache, kind: str, dtype: torch.dtype | None, forward: StepForward,
                        lengths: tuple[int, ...]) -> None:
        """`kind`'s step for each query length in `lengths`, over `cache` and every smaller slot
        bucket of its capacity (their buffers allocated like `cache`'s). A smaller bucket is not in
        use (one generation at a time: it moves there later) and is reset after; `cache` is, but its
        dummy steps write only the columns its next step writes anyway, and commit nothing."""
        device = cache.columns.device
        bucket = cache
        while True:
            for length in lengths:
                key = (kind, length, dtype)
                if key not in bucket.graphs:
                    empty = torch.zeros((bucket.slots, length), dtype=torch.long, device=device)
                    self._add(bucket, key, forward, empty, empty.clone())
            if bucket is not cache:
                bucket.reset()
            if bucket.slots == 1:
                return
            key = (bucket.slots // 2, cache.capacity)
            bucket = self.caches.get(key)
            if bucket is None or bucket.columns.device != device:
                bucket = self.caches[key] = SlotCache(*key, device=device)
            bucket.allocate_like(cache.layers)

    def _capture(self, cache: SlotCache, forward: StepForward, tokens: Tensor, positions: Tensor) -> CapturedStep:
        # the warm-up writes only the positions the step itself writes next, with the same inputs
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(WARMUP_RUNS):
                forward(cache, tokens, positions)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: another thread of the process (a weight receiver) may use CUDA meanwhile
        with torch.cuda.graph(graph, pool=self.memory_pool, capture_error_mode="thread_local"):
            outputs = forward(cache, tokens, positions)
        return CapturedStep(graph, tokens, positions, outputs)


def has_sliding_layers(model: nn.Module) -> bool:
    """Whether some layer of `model` attends through a sliding window (the static mask is full attention)."""
    return "sliding_attention" in (getattr(model.config, "layer_types", None) or ())


def static_decoder(mode: str, device: torch.device, model: nn.Module,
                   log: logging.Logger | logging.LoggerAdapter | None = None) -> StaticDecoder | None:
    """The decoder `rollout.decode: mode` asks for on `device`; None: eager decoding."""
    if mode == "graphs" and device.type != "cuda":
        raise ConfigError(f"rollout.decode=graphs: CUDA graphs need a CUDA device (this model is on {device})")
    if mode == "auto":
        mode = "graphs" if device.type == "cuda" else CPU_AUTO
        if has_sliding_layers(model):
            mode = "eager"
    if mode != "eager" and has_sliding_layers(model):
        raise ConfigError(f"rollout.decode={mode}: the model has sliding-window layers; use eager or auto")
    return None if mode == "eager" else StaticDecoder(graphs=mode == "graphs", log=log)
