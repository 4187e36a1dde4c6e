"""A small torch.distributed process group of its own, for weight sync, beside the default group.

    group = open_group("127.0.0.1:0", rank=0, world_size=2, backend="gloo", timeout_s=30.0,
                       rank_names=["trainer", "rollout-0 vLLM worker 0"], name="rollout-0",
                       announce=lambda address: publish_address(folder, "rollout-0", address))
    group.broadcast(tensor, src=0)          # gloo on CPU, NCCL on GPU: the same call
    group.close()

    address = wait_for_address(folder, "rollout-0", timeout_s=30.0)   # the other ranks
    group = open_group(address, rank=1, world_size=2, ...)

Nothing here touches torch.distributed's default group (`init_process_group`): a vLLM worker owns
one already. `rendezvous` is the store part (`cuda_ipc.py` uses it alone): rank 0 hosts a
`TCPStore` listening on the address's host only (port 0 picks a free port: `group.address` then
says which); every rank sets `joined/<rank>` in it, and rank 0 waits until all joined or
`timeout_s` passed, then raises `WeightSyncTimeout` naming the ranks that did not come (number
and name). `open_group` adds the backend object (`ProcessGroupGloo` / `ProcessGroupNCCL`), built
directly on a `PrefixStore` of its own. A gloo group on a loopback address binds its device to
127.0.0.1; on any other address it uses gloo's default device (the host name's address, or
`GLOO_SOCKET_IFNAME`).

Rank 0's port is only known once its store listens, so it is handed to the other ranks through a
file: `publish_address` writes `<folder>/<name>.json` atomically, with a token new at each
opening of the group; `wait_for_announcement` (`wait_for_address`) polls for it.
Store keys are polled with `check` (not `wait`, whose every timeout logs a C++ warning), at an
interval that grows with the time waited (1% of it, 0.2 ms to 20 ms).

A rank that finds its `joined/<rank>` set already is a restarted process meeting the group its
predecessor formed: it sets `rejoin` there, for rank 0 to open the group anew, and `rendezvous`
raises `GroupTaken` (the receiver then waits for the next token: `broadcast.py`). Rank 0 waiting
for the other ranks of a group still forming sees `rejoin` too and raises `ReceiverRestarted`
(its predecessor joined and died before the group formed). Once every rank joined, the backend's
own setup waits for each of them: a rank that dies inside it is waited for until `timeout_s`.
"""

from __future__ import annotations

import ipaddress
import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Literal, NamedTuple

import torch
import torch.distributed as dist

from stream_rlhf.atomic_file import write_text_atomically

Backend = Literal["gloo", "nccl"]
BACKENDS = ("gloo", "nccl")


class WeightSyncTimeout(TimeoutError):
    """A weight-sync peer did not appear in time; the message names the group, address and ranks."""


class WeightSyncClosed(RuntimeError):
    """A wait was given up because the waiting side is closing."""


class ReceiverRestarted(RuntimeError):
    """Rank 0's group lost a receiver rank, which a restarted process replaces: open it again."""


class GroupTaken(RuntimeError):
    """The group at this address was formed with this rank already (by the process it restarts);
    `rejoin` was set in its store."""


REJOIN = "rejoin"
"""The key a restarted rank sets in the store of the group its predecessor had joined."""


class Announcement(NamedTuple):
    """Where a group's rank 0 listens, and a token new at each opening of the group."""

    address: str
    token: str


def wait_for_keys(store: dist.Store, keys: Sequence[str], what: str, deadline: float | None = None,
                  stop: threading.Event | None = None, unless: Callable[[], bool] | None = None) -> None:
    """Block until every key exists in `store`. Past `deadline` (a `time.monotonic()` value; None:
    no limit) raises WeightSyncTimeout(`what`); once `stop` is set raises WeightSyncClosed; once
    `unless()` is true raises ReceiverRestarted."""
    start = time.monotonic()
    while not store.check(list(keys)):
        now = time.monotonic()
        if stop is not None and stop.is_set():
            raise WeightSyncClosed(f"{what}: closed while waiting for store keys {list(keys)}")
        if unless is not None and unless():
            raise ReceiverRestarted("a restarted receiver asked to join again")
        if deadline is not None and now >= deadline:
            raise WeightSyncTimeout(what)
        time.sleep(min(max((now - start) / 100, 0.0002), 0.02))


class SyncGroup:
    """One rank's membership of a weight-sync group (see `open_group`)."""

    def __init__(self, name: str, address: str, rank: int, world_size: int, store: dist.Store,
                 backend: dist.ProcessGroup):
        self.name = name
        self.address = address
        """host:port of rank 0's store (with the port it really listens on)."""
        self.rank = rank
        self.world_size = world_size
        self._store: dist.Store | None = store
        self._backend: dist.ProcessGroup | None = backend

    @property
    def store(self) -> dist.Store:
        """The group's key-value store (a PrefixStore: keys do not clash with other groups')."""
        if self._store is None:
            raise RuntimeError(f"weight-sync group {self.name!r} at {self.address}: store used after close()")
        return self._store

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        """Broadcast `tensor` in place from rank `src` to every rank of the group."""
        self.broadcast_many([tensor], src)

    def broadcast_many(self, tensors: Sequence[torch.Tensor], src: int) -> None:
        """Broadcast each tensor from `src`; all are issued before any is waited for (with gloo this
        is 2-3x faster than one at a time). Returns once every tensor is sent / received."""
        if self._backend is None:
            raise RuntimeError(f"weight-sync group {self.name!r} at {self.address}: broadcast after close()")
        options = dist.BroadcastOptions()
        options.rootRank = src
        works = [self._backend.broadcast([tensor], options) for tensor in tensors]
        for work in works:
            work.wait()
        if any(tensor.is_cuda for tensor in tensors):  # NCCL's wait() only orders streams: finish the copies
            torch.cuda.current_stream().synchronize()

    def close(self) -> None:
        """Shut the backend down and drop the store (rank 0: its server stops once nothing else
        holds it, and the other ranks' store calls then fail)."""
        if self._backend is not None:
            self._backend.shutdown()
        self._backend = None
        self._store = None


def open_group(address: str, rank: int, world_size: int, backend: Backend, timeout_s: float,
               rank_names: Sequence[str], name: str,
               announce: Callable[[str], None] | None = None, stop: threading.Event | None = None) -> SyncGroup:
    """Join (rank 0: host) the group `name` whose store is at `address` ("host:port"; rank 0 may
    give port 0): `rendezvous`, then the backend's process group on the group's ranks."""
    if backend not in BACKENDS:
        raise ValueError(f"weight-sync group {name!r}: backend={backend!r}: must be one of {BACKENDS}")
    store, address = rendezvous(address, rank, world_size, timeout_s, rank_names, name, announce, stop)
    host, _ = _split_address(address, name)
    process_group = _backend(backend, dist.PrefixStore("backend", store), rank, world_size, host,
                             timedelta(seconds=timeout_s))
    return SyncGroup(name, address, rank, world_size, store, process_group)


def rendezvous(address: str, rank: int, world_size: int, timeout_s: float, rank_names: Sequence[str], name: str,
               announce: Callable[[str], None] | None = None,
               stop: threading.Event | None = None) -> tuple[dist.PrefixStore, str]:
    """Host (rank 0) or reach the store at `address` and wait until every rank joined; returns the
    group's store and the real address. `announce`, rank 0 only, is called with that address
    once the store listens, before the wait (e.g. `publish_address`). Raises WeightSyncTimeout
    when a rank is missing after `timeout_s`, WeightSyncClosed when rank 0's `stop` is set while
    it waits for the others, ReceiverRestarted (rank 0) when a restarted rank asked to join again
    meanwhile, and GroupTaken (that restarted rank)."""
    if not 0 <= rank < world_size:
        raise ValueError(f"weight-sync group {name!r}: rank={rank}: must be in [0, world_size={world_size})")
    if len(rank_names) != world_size:
        raise ValueError(f"weight-sync group {name!r}: {len(rank_names)} rank_names {list(rank_names)}: "
                         f"need one per rank (world_size={world_size}, rank 0 = the sender)")
    if announce is not None and rank != 0:
        raise ValueError(f"weight-sync group {name!r}: announce is for rank 0, not rank {rank}")
    host, port = _split_address(address, name)
    timeout = timedelta(seconds=timeout_s)
    deadline = time.monotonic() + timeout_s
    if rank == 0:  # listens on `host` only (TCPStore's own socket would listen on every interface)
        listener = socket.create_server((host, port), backlog=128)
        port = listener.getsockname()[1]
        host_store = dist.TCPStore(host, port, is_master=True, timeout=timeout, wait_for_workers=False,
                                   master_listen_fd=listener.detach())
        address = f"{host}:{port}"
        if announce is not None:
            announce(address)
    else:
        _wait_reachable(host, port, deadline, f"weight-sync group {name!r} at {address}: rank 0 "
                        f"({rank_names[0]}) was not reachable within {timeout_s}s")
        host_store = dist.TCPStore(host, port, is_master=False, timeout=timeout)
    store = dist.PrefixStore(name, host_store)
    if rank != 0 and store.check([f"joined/{rank}"]):
        store.set(REJOIN, str(rank))
        raise GroupTaken(f"weight-sync group {name!r} at {address}: rank {rank} ({rank_names[rank]}) joined it "
                         "before: this is a restarted process; asked rank 0 to open the group again")
    store.set(f"joined/{rank}", "1")
    if rank == 0:
        restarted = None
        try:
            _wait_for_ranks(store, world_size, rank_names, deadline, f"weight-sync group {name!r} at {address}",
                            timeout_s, stop)
        except ReceiverRestarted as exc:
            restarted = str(exc)
        if restarted is not None:  # outside the handler: no traceback keeps the store alive
            del store, host_store  # its server stops: the ranks of this opening fail now, not at their timeout
            raise ReceiverRestarted(restarted)
    return store, address


def _wait_for_ranks(store: dist.Store, world_size: int, rank_names: Sequence[str], deadline: float,
                    where: str, timeout_s: float, stop: threading.Event | None) -> None:
    """Until every rank joined; ReceiverRestarted once a restarted process asks to join again (its
    predecessor joined and died while the others were still coming)."""
    rejoined = partial(store.check, [REJOIN])
    try:
        wait_for_keys(store, [f"joined/{r}" for r in range(1, world_size)], where, deadline, stop, unless=rejoined)
    except WeightSyncTimeout:
        missing = [r for r in range(1, world_size) if not store.check([f"joined/{r}"])]
        listed = ", ".join(f"{r} ({rank_names[r]})" for r in missing)
        raise WeightSyncTimeout(f"{where}: rank(s) {listed} did not join within {timeout_s}s") from None
    if rejoined():
        raise ReceiverRestarted("a restarted receiver asked to join again before the group formed")


def _backend(backend: Backend, store: dist.Store, rank: int, world_size: int, host: str,
             timeout: timedelta) -> dist.ProcessGroup:
    if backend == "gloo":
        options = dist.ProcessGroupGloo._Options()
        options._timeout = timeout
        options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1") if _is_loopback(host)
                            else dist.ProcessGroupGloo.create_default_device()]
        return dist.ProcessGroupGloo(store, rank, world_size, options)
    nccl = getattr(dist, "ProcessGroupNCCL", None)
    if nccl is None:
        raise ValueError(f"backend='nccl': this torch build ({torch.__version__}) has no NCCL; use 'gloo'")
    options = nccl.Options()
    options._timeout = timeout
    return nccl(store, rank, world_size, options)


def _split_address(address: str, name: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"weight-sync group {name!r}: address={address!r}: expected 'host:port'")
    return host.strip("[]"), int(port)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def reachable(address: str, within_s: float, name: str) -> bool:
    """Whether something listens at group `name`'s `address` ("host:port"), tried for up to `within_s`."""
    host, port = _split_address(address, name)
    try:
        _wait_reachable(host, port, time.monotonic() + within_s, "")
    except WeightSyncTimeout:
        return False
    return True


def _wait_reachable(host: str, port: int, deadline: float, message: str) -> None:
    """Retry a plain TCP connect until it succeeds (TCPStore's own retry logs C++ stack traces)."""
    while True:
        try:
            with socket.create_connection((host, port), timeout=max(0.05, min(1.0, deadline - time.monotonic()))):
                return
        except OSError:
            if time.monotonic() >= deadline:
                raise WeightSyncTimeout(message) from None
            time.sleep(0.05)


def address_file(folder: Path, name: str) -> Path:
    """Where group `name`'s rank 0 publishes its store address (`publish_address`)."""
    return Path(folder) / f"{name}.json"


def publish_address(folder: Path, name: str, address: str) -> Path:
    """Write `<folder>/<name>.json` atomically with the group's store address and a new token;
    returns its path."""
    record = {"name": name, "address": address, "token": new_token(), "pid": os.getpid()}
    return write_text_atomically(address_file(folder, name), json.dumps(record))


def new_token() -> str:
    return uuid.uuid4().hex


def wait_for_announcement(folder: Path, name: str, timeout_s: float, after: str | None = None) -> Announcement:
    """What `publish_address` wrote for group `name` (with a token other than `after`, when
    given); raises WeightSyncTimeout naming the group and the file once `timeout_s` passed
    without it."""
    path = address_file(folder, name)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            record = json.loads(path.read_text())
            if record["token"] != after:
                return Announcement(record["address"], record["token"])
        except FileNotFoundError:
            pass
        if time.monotonic() >= deadline:
            raise WeightSyncTimeout(
                f"weight-sync group {name!r}: its {'new ' if after else ''}address never appeared at {path} within "
                f"{timeout_s}s (is the trainer's sender running with this folder and group name?)") from None
        time.sleep(0.02)


def wait_for_address(folder: Path, name: str, timeout_s: float) -> str:
    return wait_for_announcement(folder, name, timeout_s).address
