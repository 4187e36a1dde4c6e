"""One protocol for every weight transport, and the one table that maps `weights.transport` to it.

    link = Link.of(job.weights_root, "actor", job.config.weights)    # where the ends meet
    transport = TRANSPORTS[job.config.weights.transport]
    sender = transport.open_sender(link, {"rollout-0": 2})             # trainer: group -> world size
    sender.publish(named, version=3)                                    # [(name, tensor)]
    receiver = transport.join(link, "rollout-0", rank=1, world_size=2, device=torch.device("cpu"))
    received = receiver.receive(min_version=3)                          # (version, [(name, tensor)]) or None
    receiver.close()
    sender.close()

| transport   | sender.publish                            | receiver.receive(min_version)                  |
|-------------|-------------------------------------------|------------------------------------------------|
| `shm`       | the version into the store (/dev/shm), if | the store's newest version if >= min_version,  |
|             | the store lacks it                        | else None (the store shows what exists)        |
| `broadcast` | a snapshot; each group's thread broadcasts| asks the sender for its newest >= min_version, |
|             | it when the group asks (gloo / NCCL)      | waits for it                                   |
| `cuda_ipc`  | a snapshot on the GPU; its IPC handles go | as broadcast, copied from the sender's GPU     |
|             | to the receiver that asks                 | buffers                                        |

Received tensors are views valid until the next receive() of the same receiver (load them, or
copy them, first): no transport copies more than it must. A receiver asked for a version waits for
the sender (broadcast, cuda_ipc) unless `stop` is set, then raises `WeightSyncClosed`. A trainer
writes every version to its store anyway (its forwards read it there), so the shm sender's write
is skipped then: each version is written once. Which version to ask for and when is the caller's
(`stages/weight_sync.py`, `stages/critic_weights.py`); the vLLM workers join through the same table
(`backends/vllm_worker.py`), which is why a `Link` is plain values (it crosses the engine's RPC).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import NamedTuple, Protocol

import torch
from torch import Tensor

from stream_rlhf.weights.address_book import book_of, sender_host
from stream_rlhf.weights.broadcast import BroadcastReceiver, BroadcastSender
from stream_rlhf.weights.cuda_ipc import CudaIpcReceiver, CudaIpcSender
from stream_rlhf.weights.group import Backend
from stream_rlhf.weights.shm_store import ShmReceiver, ShmSender, WeightStore
from stream_rlhf.weights.sync_config import WeightSyncConfig

Named = list[tuple[str, Tensor]]
Received = tuple[int, Named]
"""(version, [(name, tensor)]): what a receiver got."""


class WeightSender(Protocol):
    """A trainer's end of a transport."""

    def publish(self, named: Iterable[tuple[str, Tensor]], version: int) -> None:
        """Make `named` version `version` (greater than the last) for the receivers' next asks."""

    def close(self) -> None:
        """Stop serving; raises a transfer's failure not raised before."""


class WeightReceiver(Protocol):
    """One receiver rank of a transport."""

    def receive(self, min_version: int = 0, stop: threading.Event | None = None) -> Received | None:
        """The newest version >= `min_version` (see the module's table), or None."""

    def close(self) -> None:
        """Leave the transport (a receiver joins once per sender)."""


@dataclass(frozen=True)
class Link:
    """Where a model's versions and their transport's ends meet: plain values only."""

    root: str
    """The job's weight-store root (`shm_store.weights_root`)."""
    model: str
    """Whose versions: the store's folder under `root` ("actor", "critic")."""
    book: str
    """Where broadcast groups' addresses go: the launcher's `tcp://` store across hosts, else the
    `groups` folder beside the store (`address_book.py`)."""
    backend: Backend
    """Broadcast groups' backend: "nccl" where CUDA is, else "gloo"."""
    bucket_bytes: int
    timeout_s: float
    """How long a group waits for its ranks to join."""

    @classmethod
    def of(cls, root: str | Path, model: str, cfg: WeightSyncConfig) -> Link:
        return cls(str(root), model, str(book_of(groups_folder(root))), "nccl" if torch.cuda.is_available() else "gloo",
                   cfg.bucket_mb << 20, cfg.timeout_s)

    def store(self) -> WeightStore:
        return WeightStore(Path(self.root), self.model)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Link:
        return cls(**json.loads(text))


def groups_folder(root: str | Path) -> Path:
    """The folder beside the store where one host's groups meet (CUDA IPC always does)."""
    return Path(root) / "groups"


class OpenSender(Protocol):
    def __call__(self, link: Link, groups: dict[str, int],
                 rank_names: dict[str, list[str]] | None = None) -> WeightSender:
        """The trainer's end for `groups` (name -> world size: the sender and the group's receiver
        ranks); `rank_names` name each rank in errors (rank 0, the sender, first)."""


class Join(Protocol):
    def __call__(self, link: Link, group: str, rank: int, world_size: int, device: torch.device) -> WeightReceiver:
        """Receiver `rank` (1 .. world_size - 1) of `group`, holding what it receives on `device`."""


class Transport(NamedTuple):
    open_sender: OpenSender
    join: Join
    one_host: bool
    """Its ends meet on one host (a /dev/shm store, a GPU's memory): the plan keeps them together."""
    needs_cuda: bool
    """Both ends need the same CUDA device."""


def _shm_sender(link: Link, groups: dict[str, int], rank_names: dict[str, list[str]] | None = None) -> ShmSender:
    return ShmSender(link.store())


def _shm_join(link: Link, group: str, rank: int, world_size: int, device: torch.device) -> ShmReceiver:
    return ShmReceiver(link.store())


def _broadcast_sender(link: Link, groups: dict[str, int],
                      rank_names: dict[str, list[str]] | None = None) -> BroadcastSender:
    return BroadcastSender(link.book, groups, link.backend, link.bucket_bytes, link.timeout_s, rank_names,
                           host=sender_host(link.book))


def _broadcast_join(link: Link, group: str, rank: int, world_size: int, device: torch.device) -> BroadcastReceiver:
    return BroadcastReceiver.join(link.book, group, rank, world_size, link.backend, link.timeout_s, device)


def _cuda_ipc_sender(link: Link, groups: dict[str, int],
                     rank_names: dict[str, list[str]] | None = None) -> CudaIpcSender:
    if wider := {name: size for name, size in groups.items() if size != 2}:
        raise ValueError(f"weights.transport=cuda_ipc: groups {wider}: one receiver rank per group")
    return CudaIpcSender(groups_folder(link.root), list(groups), link.bucket_bytes, link.timeout_s)


def _cuda_ipc_join(link: Link, group: str, rank: int, world_size: int, device: torch.device) -> CudaIpcReceiver:
    return CudaIpcReceiver.join(groups_folder(link.root), group, link.timeout_s, device)


TRANSPORTS: dict[str, Transport] = {
    "shm": Transport(_shm_sender, _shm_join, one_host=True, needs_cuda=False),
    "broadcast": Transport(_broadcast_sender, _broadcast_join, one_host=False, needs_cuda=False),
    "cuda_ipc": Transport(_cuda_ipc_sender, _cuda_ipc_join, one_host=True, needs_cuda=True),
}
"""`weights.transport` -> its two ends and where they may run (the config's Literal lists the same
names; the plan's checks read `one_host` and `needs_cuda` here, `driver/plan.py`, `driver/dataflow.py`)."""
