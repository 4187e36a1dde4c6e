"""A megatron training step's metrics over its data-parallel replicas, the same on every rank.

    metrics = replica_metrics(metrics, writer, tokens, total)   # every rank of the stage group calls it

Only some ranks hold a replica's metrics (its last pipeline stage's tp and cp rank 0: the writer);
the others pass what they have (nothing on a first pipeline stage). Means are weighted by each
replica's share of the step's tokens; `*_max` metrics take the largest.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def replica_metrics(metrics: dict[str, float], writer: bool, tokens: float, total: float) -> dict[str, float]:
    """Token-weighted means (maxima for `*_max`) of the writers' `metrics` over the replicas; the
    names come from the lowest-ranked writer, broadcast as text. `tokens`: this replica's, `total`:
    the step's."""
    first_writer = torch.tensor([dist.get_rank() if writer else dist.get_world_size()])
    dist.all_reduce(first_writer, op=dist.ReduceOp.MIN)
    names = _broadcast_names(sorted(metrics), int(first_writer.item()))
    means = [n for n in names if not n.endswith("_max")]
    tops = [n for n in names if n.endswith("_max")]
    summed = torch.tensor([metrics[n] * tokens / max(total, 1.0) if writer else 0.0 for n in means],
                          dtype=torch.float64)
    dist.all_reduce(summed)
    top = torch.tensor([metrics[n] if writer else -float("inf") for n in tops], dtype=torch.float64)
    dist.all_reduce(top, op=dist.ReduceOp.MAX)
    return {**dict(zip(means, summed.tolist())), **dict(zip(tops, top.tolist()))}


def _broadcast_names(names: list[str], source: int) -> list[str]:
    """`names` of global rank `source`, on every rank (UTF-8 over the default group)."""
    frame = "\n".join(names).encode() if dist.get_rank() == source else b""
    size = torch.tensor([len(frame)], dtype=torch.int64)
    dist.broadcast(size, src=source)
    if frame:
        data = torch.frombuffer(bytearray(frame), dtype=torch.uint8)
    else:
        data = torch.empty(int(size.item()), dtype=torch.uint8)
    dist.broadcast(data, src=source)
    text = data.numpy().tobytes().decode()
    return text.split("\n") if text else []
