"""Versioned weight updates from the trainer to rollout instances over torch.distributed broadcast
groups (gloo on CPU, NCCL on GPU), asked for by each receiver when it is ready.

    # trainer (stage actor_train): one group per rollout instance, 1 sender + its receiver ranks
    sender = BroadcastSender(folder, {"rollout-0": 2, "rollout-1": 3}, "gloo", 64 << 20, timeout_s=60.0)
    sender.publish(model.named_parameters(), version=3)     # snapshot; returns at once
    sender.check()                                          # raises a group's failure, if any
    sender.close()

    # every receiver rank of "rollout-1" (ranks 1 and 2, e.g. vLLM workers), the same calls
    receiver = BroadcastReceiver.join(folder, "rollout-1", rank=1, world_size=3, backend="gloo", timeout_s=60.0)
    version, named = receiver.receive(min_version=3)        # [(name, tensor)]; then load them
    receiver.close()

Protocol, per group (the store is the group's TCPStore, hosted by the sender's thread):

    sender thread                                  receiver ranks
    open group (rank 0), publish (address book) <-   lookup, join
    wait for request/<n> ......................    rank 1 sets request/<n> = min_version
    wait for a snapshot with version >= min
    set layout (first time), reply/<n> = version   all ranks wait for reply/<n>
    broadcast header [n, version], buckets   ->    receive them into their buffers

waits for / unblocked by: the sender thread waits for a request (a receiver calling receive) and
then for a new enough snapshot (`publish`); receivers wait for the reply, which needs that
snapshot. Each group has its own thread, so no rollout instance waits for another; a group
gets the newest snapshot at the time of its request (versions published in between are skipped).
All receiver ranks of a group must call receive() the same number of times with the same
min_version (a collective); rank 1's request is the one that counts.

A group's thread failing (a receiver not joining within `timeout_s`, a broadcast timing out) is
raised in the trainer's thread by the next publish(), check() or close(). The sender removes its
groups' stale address files when it starts, so start it before the receivers, or give each run
its own folder.

A receiver process that died is replaced by a restarted one (the launcher restarts rollout): the
new process finds the group formed with its rank already, sets `rejoin` in its store and waits
for the group's next opening (`group.GroupTaken`). The group's thread, waiting for a request or
a snapshot (or for the other ranks of a group still forming), sees `rejoin` (or its broadcast
fails: the peer is gone), closes the group and opens it again under a new address token, and the
group goes on from request 1 with the newest snapshot; the other groups never notice. A rank of
the old opening still forming the group (its store then closes) joins the new one. On NCCL a
broadcast to a rank that died waits for the group's timeout first.

Across hosts the addresses go through a store instead of a folder (`address_book.py`: `folder` is
then `tcp://HOST:PORT`), and the sender binds `host`, its interface towards that store.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

from stream_rlhf.telemetry import trace
from stream_rlhf.weights.address_book import forget, lookup, publish
from stream_rlhf.weights.buckets import BucketLayout, empty_buckets, unpack
from stream_rlhf.weights.group import (
    BACKENDS,
    REJOIN,
    Backend,
    GroupTaken,
    ReceiverRestarted,
    SyncGroup,
    WeightSyncTimeout,
    open_group,
    reachable,
    wait_for_keys,
)
from stream_rlhf.weights.sender import SnapshotSender

SENDER_NAME = "trainer (weight sender)"
REACH_S = 1.0
"""A joining receiver tries an announced address this long before looking again (a group being
opened anew closed the store of its last address)."""
log = logging.getLogger(__name__)


class BroadcastSender(SnapshotSender):
    """The trainer's end: one serving thread per group (see the module docstring)."""

    def __init__(self, folder: Path | str, groups: dict[str, int], backend: Backend, bucket_bytes: int,
                 timeout_s: float, rank_names: dict[str, list[str]] | None = None, host: str = "127.0.0.1"):
        """`groups`: group name -> world size (1 sender + the instance's receiver ranks).
        `rank_names`: group name -> a name for each rank, rank 0 first, used in errors (default:
        "<group> receiver rank <r>"). Stale address files of these groups in `folder` are removed."""
        if not groups:
            raise ValueError("BroadcastSender: no groups")
        if backend not in BACKENDS:
            raise ValueError(f"BroadcastSender: backend={backend!r}: must be one of {BACKENDS}")
        for name, world_size in groups.items():
            if world_size < 2:
                raise ValueError(f"BroadcastSender: groups[{name!r}]={world_size}: a group needs >= 2 ranks")
            if rank_names is not None and len(rank_names.get(name, ())) != world_size:
                raise ValueError(f"BroadcastSender: rank_names[{name!r}]={rank_names.get(name)}: "
                                 f"need {world_size} names, rank 0 (the sender) first")
        self.groups = dict(groups)
        self.backend = backend
        self.rank_names = {name: list(rank_names[name]) if rank_names else default_rank_names(name, world_size)
                           for name, world_size in groups.items()}
        super().__init__(folder, groups, bucket_bytes, timeout_s, host)

    def _serve(self, name: str, stop: threading.Event) -> None:
        try:
            for opening in itertools.count(1):  # once more each time a restarted receiver replaces one
                try:
                    group = open_group(f"{self.host}:0", 0, self.groups[name], self.backend, self.timeout_s,
                                       self.rank_names[name], name, announce=partial(publish, self.folder, name),
                                       stop=stop)
                except ReceiverRestarted as exc:
                    log.warning("weight-sync group %r: %s: opening it again for the restarted receiver (up to %.0fs)",
                                name, exc, self.timeout_s)
                    continue
                if opening > 1:
                    log.warning("weight-sync group %r: the restarted receiver joined", name)
                try:
                    for request in itertools.count(1):
                        self._answer(group, request, stop)
                except ReceiverRestarted as exc:
                    log.warning("weight-sync group %r: %s: opening it again for the restarted receiver (up to %.0fs)",
                                name, exc, self.timeout_s)
                finally:
                    group.close()
        finally:
            forget(self.folder, name)

    def _answer(self, group: SyncGroup, request: int, stop: threading.Event) -> None:
        """Wait for request `request` of the group's rank 1 and broadcast the snapshot it asks for;
        ReceiverRestarted when a restarted receiver asks to join again meanwhile or the broadcast
        fails (see the module docstring)."""
        store = group.store
        rejoined = partial(store.check, [REJOIN])
        wait_for_keys(store, [f"request/{request}"], f"weight-sync group {group.name!r}", stop=stop, unless=rejoined)
        min_version = int(store.get(f"request/{request}"))
        snapshot = self._slot.acquire(min_version, stop, unless=rejoined)
        try:
            if request == 1:
                store.set("layout", self._slot.layout.to_json())
            store.set(f"reply/{request}", str(snapshot.version))
            header = torch.tensor([request, snapshot.version], dtype=torch.int64, device=snapshot.buckets[0].device)
            with trace.span("weights send", "weights", version=snapshot.version, group=group.name,
                            transport="broadcast"):
                try:
                    group.broadcast_many([header, *snapshot.buckets], src=0)
                except (RuntimeError, dist.DistError) as exc:
                    if stop.is_set():
                        raise
                    raise ReceiverRestarted(f"the broadcast of version {snapshot.version} failed "
                                            f"({type(exc).__name__}: {str(exc)[:200]})") from exc
        finally:
            self._slot.release(snapshot)
        store.delete_key(f"request/{request}")
        if request > 1:  # every receiver rank is past it: it took part in this broadcast
            store.delete_key(f"reply/{request - 1}")


class BroadcastReceiver:
    """One receiver rank of a group (see the module docstring); make it with `join`."""

    def __init__(self, group: SyncGroup, device: torch.device | str):
        self.group = group
        self.device = torch.device(device)
        self._requests = 0
        self._layout: BucketLayout | None = None
        self._buckets: list[torch.Tensor] = []

    @classmethod
    def join(cls, folder: Path | str, name: str, rank: int, world_size: int, backend: Backend, timeout_s: float,
             device: torch.device | str = "cpu") -> BroadcastReceiver:
        """Wait (up to `timeout_s`) for group `name`'s sender to publish its address in `folder` (an
        address book, `address_book.py`: a folder or `tcp://HOST:PORT`), then join the group as `rank`
        (1 .. world_size-1). A process restarted in place of one that had joined waits (up to
        `timeout_s` more) for the group's next opening (see the module docstring)."""
        if not 1 <= rank < world_size:
            raise ValueError(f"weight-sync group {name!r}: receiver rank={rank}: must be in [1, {world_size})")
        if backend == "nccl" and torch.device(device).type != "cuda":
            raise ValueError(f"weight-sync group {name!r}: backend='nccl' needs a CUDA device, not {device!r}")
        announced = lookup(folder, name, timeout_s)
        deadline = time.monotonic() + timeout_s  # to join it, or a later opening of it (after a restart)
        while True:
            if not reachable(announced.address, min(REACH_S, max(0.0, deadline - time.monotonic())), name):
                if time.monotonic() >= deadline:  # its store closed and no newer one came
                    raise WeightSyncTimeout(f"weight-sync group {name!r} at {announced.address}: rank 0 "
                                            f"({SENDER_NAME}) was not reachable within {timeout_s}s")
                announced = lookup(folder, name, max(0.0, deadline - time.monotonic()))  # opened again meanwhile?
                continue
            try:
                group = open_group(announced.address, rank, world_size, backend, timeout_s,
                                   default_rank_names(name, world_size), name)
            except GroupTaken:  # the group this rank's predecessor joined: wait for its next opening
                announced = lookup(folder, name, max(0.0, deadline - time.monotonic()), after=announced.token)
                continue
            except RuntimeError as exc:  # (a DistError too) its store closed while forming: opened again?
                try:
                    announced = lookup(folder, name, REACH_S, after=announced.token)
                except WeightSyncTimeout:
                    raise exc from None
                log.warning("weight-sync group %r: rank %d: the group was opened again while it formed (%s); "
                            "joining the new one", name, rank, str(exc)[:200])
                continue
            return cls(group, device)

    def receive(self, min_version: int = 0,
                stop: threading.Event | None = None) -> tuple[int, list[tuple[str, torch.Tensor]]]:
        """Ask for the newest weights with a version >= `min_version` and wait for them (as long
        as the sender is alive). Returns (version, [(name, tensor)]): views into this receiver's
        buffers, valid until the next receive() overwrites them in place; copy them (or load them
        into the model) before calling again. Once `stop` is set before the sender replied, raises
        WeightSyncClosed (the receiver is then out of step with its group: close it)."""
        self._requests += 1
        request, store, where = self._requests, self.group.store, f"weight-sync group {self.group.name!r}"
        try:
            if self.group.rank == 1:
                store.set(f"request/{request}", str(min_version))
            wait_for_keys(store, [f"reply/{request}"], where, stop=stop)
            version = int(store.get(f"reply/{request}"))
            if self._layout is None:
                self._layout = BucketLayout.from_json(store.get("layout").decode())
                self._buckets = empty_buckets(self._layout, self.device)
        except dist.DistError as exc:
            raise RuntimeError(f"{where} at {self.group.address}: lost the sender's store while waiting for "
                               f"version >= {min_version}: {exc}") from exc
        header = torch.empty(2, dtype=torch.int64, device=self.device)
        with trace.span("weights receive", "weights", version=version, group=self.group.name, transport="broadcast"):
            self.group.broadcast_many([header, *self._buckets], src=0)
        if header.tolist() != [request, version] or version < min_version:
            raise RuntimeError(f"{where}: out of step: asked request {request} for version >= {min_version}, "
                               f"announced version {version}, got header {header.tolist()}")
        return version, unpack(self._buckets, self._layout)

    def close(self) -> None:
        self.group.close()


def default_rank_names(name: str, world_size: int) -> list[str]:
    return [SENDER_NAME, *(f"{name} receiver rank {rank}" for rank in range(1, world_size))]
