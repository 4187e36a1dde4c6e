"""The ranks of one stage instance: a torch.distributed group whose leader speaks for it.

    group = RankGroup.join(RankSpec(rank=1, world_size=2, init_method="file:///tmp/g/actor_train-0", device="cpu"))
    message = group.share(None)          # a follower receives what the leader shares...
    group.share(GroupBatch(handle))      # ...the leader (rank 0) shares it
    mine = group.shard(len(samples))     # this rank's contiguous slice of a mini-batch
    outputs = group.gather_ragged(local) # every rank's (L_i,) tensors, in rank order

Only the leader is a broker client (`broker/runtime/runner.py`); it shares each delivered handle with the other
ranks, which fetch its payload themselves (`group_follower.py`). CPU tensors travel over gloo,
CUDA tensors over NCCL: a CUDA group is initialised with both backends. A group of one rank
(`RankGroup.single`) has no process group, and every collective returns at once.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from stream_rlhf.broker.control.messages import GroupMessage, decode_group, encode


@dataclass(frozen=True)
class RankSpec:
    """Where one rank of a stage instance stands in its group (set by the launcher)."""

    rank: int = 0
    world_size: int = 1
    init_method: str | None = None
    """The group's rendezvous, a torch.distributed init URL: `file:///path` (a FileStore, fresh for
    every start of the group; the local launcher's) or `tcp://host:port` (rank 0 listens there)."""
    device: str = "cpu"
    """`cpu` or `cuda:N`: where this rank's models live."""
    timeout_s: float = 3600.0
    """How long a collective may wait: a follower waits this long for the leader's next handle."""

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank={self.rank}: must be in [0, world_size={self.world_size})")
        if self.world_size > 1 and not self.init_method:
            raise ValueError(f"world_size={self.world_size}: a group of several ranks needs an init_method")


class RankGroup:
    def __init__(self, rank: int, world_size: int, device: torch.device, process_group: dist.ProcessGroup | None):
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.process_group = process_group
        self.stopped_together = world_size == 1
        """Every rank left the step loop at the same point (the leader shared GroupStop, each
        follower received it), so the stage's close() runs on every rank and may hold a collective
        (a trainer's drain checkpoint). False after a failure: the other ranks may be gone."""

    @classmethod
    def single(cls, device: str | torch.device = "cpu") -> RankGroup:
        return cls(0, 1, torch.device(device), None)

    @classmethod
    def join(cls, spec: RankSpec) -> RankGroup:
        """Join the group of `spec` (blocks until every rank has joined, up to `timeout_s`)."""
        device = torch.device(spec.device)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        if spec.world_size == 1:
            return cls.single(device)
        backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=spec.init_method, rank=spec.rank,
                                world_size=spec.world_size, timeout=datetime.timedelta(seconds=spec.timeout_s))
        return cls(spec.rank, spec.world_size, device, dist.group.WORLD)

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def share(self, message: GroupMessage | None) -> GroupMessage | None:
        """The leader's `message`, on every rank (followers pass None). Over gloo, as MessagePack."""
        if not self.distributed:
            return message
        frame = encode(message) if self.is_leader else b""
        size = torch.tensor([len(frame)], dtype=torch.int64)
        dist.broadcast(size, src=0, group=self.process_group)
        data = torch.frombuffer(bytearray(frame), dtype=torch.uint8) if self.is_leader else \
            torch.empty(int(size.item()), dtype=torch.uint8)
        dist.broadcast(data, src=0, group=self.process_group)
        return message if self.is_leader else decode_group(data.numpy().tobytes())

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier(group=self.process_group)

    def shard(self, n: int) -> slice:
        """This rank's contiguous share of `n` items (the first `n % world_size` ranks get one more)."""
        base, extra = divmod(n, self.world_size)
        start = self.rank * base + min(self.rank, extra)
        return slice(start, start + base + (self.rank < extra))

    def sum(self, values: list[float]) -> list[float]:
        """Element-wise sum of `values` over the ranks (float64, on every rank)."""
        if not self.distributed:
            return list(values)
        total = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(total, group=self.process_group)
        return total.tolist()

    def max(self, values: list[float]) -> list[float]:
        if not self.distributed:
            return list(values)
        top = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=self.process_group)
        return top.tolist()

    def gather_ragged(self, local: list[Tensor]) -> list[Tensor]:
        """Every rank's list of 1-D tensors (one dtype), concatenated in rank order, on the CPU and
        on every rank: what a data-parallel forward stage computed for its share of a mini-batch."""
        if not self.distributed:  # one copy to the host (a device-to-host copy waits for the device)
            return list(torch.cat(local).cpu().split([len(t) for t in local])) if local else []
        dtype = local[0].dtype if local else torch.float32
        counts = torch.tensor([len(local)], dtype=torch.int64)
        all_counts = [torch.zeros_like(counts) for _ in range(self.world_size)]
        dist.all_gather(all_counts, counts, group=self.process_group)
        most = max(int(c.item()) for c in all_counts)
        lengths = torch.zeros(most, dtype=torch.int64)
        lengths[: len(local)] = torch.tensor([len(t) for t in local], dtype=torch.int64)
        all_lengths = [torch.zeros_like(lengths) for _ in range(self.world_size)]
        dist.all_gather(all_lengths, lengths, group=self.process_group)
        widest = max(int(x.sum().item()) for x in all_lengths)
        flat = torch.zeros(widest, dtype=dtype)
        if local:
            joined = torch.cat([t.detach().cpu().to(dtype) for t in local])
            flat[: len(joined)] = joined
        all_flat = [torch.zeros_like(flat) for _ in range(self.world_size)]
        dist.all_gather(all_flat, flat, group=self.process_group)
        out = []
        for count, rank_lengths, data in zip(all_counts, all_lengths, all_flat):
            sizes = rank_lengths[: int(count.item())].tolist()
            out += list(data[: sum(sizes)].split(sizes))
        return out

    def close(self) -> None:
        if self.distributed and dist.is_initialized():
            dist.destroy_process_group()
