"""The CUDA caching allocator's state as a trace counter, after each training step on a GPU: growth
in steady state (new segments, i.e. cudaMalloc calls, and retries after a failed one) stalls a step
as a first-use compile does (issue 32), and shows here next to the steps it lands in.

    allocator_counter(device)   # "cuda allocator": allocated_mb, reserved_mb, segments, retries
"""

from __future__ import annotations

import torch

from stream_rlhf.telemetry import trace

MB = 1 << 20


def allocator_counter(device: torch.device) -> None:
    """One sample of the "cuda allocator" counter for `device` (nothing without a trace or a GPU):
    MB allocated and reserved now, and the segments allocated and allocation retries so far."""
    if device.type != "cuda" or not trace.enabled():
        return
    stats = torch.cuda.memory_stats(device)
    trace.counter("cuda allocator", allocated_mb=round(stats.get("allocated_bytes.all.current", 0) / MB, 1),
                  reserved_mb=round(stats.get("reserved_bytes.all.current", 0) / MB, 1),
                  segments=stats.get("segment.all.allocated", 0), retries=stats.get("num_alloc_retries", 0))
