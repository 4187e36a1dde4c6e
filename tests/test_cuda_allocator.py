"""The "cuda allocator" trace counter (`telemetry/cuda_allocator.py`): a GPU training step samples
the caching allocator into the trace; on the CPU, or without a trace, nothing is written."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from stream_rlhf.telemetry import trace
from stream_rlhf.telemetry.cuda_allocator import allocator_counter


def _counters(folder) -> list[dict]:
    events = [json.loads(line) for path in folder.glob("*.jsonl") for line in path.read_text().splitlines()]
    return [e for e in events if e.get("ph") == "C" and e.get("name") == "cuda allocator"]


def test_the_cpu_samples_nothing(tmp_path):
    trace.start(tmp_path, process="actor_train-0", thread="rank 0")
    try:
        allocator_counter(torch.device("cpu"))
    finally:
        trace.stop()
    assert _counters(tmp_path) == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="samples the CUDA caching allocator")
def test_a_gpu_step_samples_the_allocator_into_the_trace(tmp_path):
    device = torch.device("cuda", 0)
    allocator_counter(device)  # no trace: nothing, no error
    trace.start(tmp_path, process="actor_train-0", thread="rank 0")
    try:
        layer = nn.Linear(256, 256).to(device)
        layer(torch.randn(64, 256, device=device)).sum().backward()
        allocator_counter(device)
    finally:
        trace.stop()
    [sample] = _counters(tmp_path)
    assert sample["args"]["allocated_mb"] > 0 and sample["args"]["reserved_mb"] >= sample["args"]["allocated_mb"]
    assert sample["args"]["segments"] >= 1 and sample["args"]["retries"] >= 0
