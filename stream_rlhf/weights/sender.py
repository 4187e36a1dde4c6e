"""The trainer side shared by the weight senders (`broadcast.py`, `cuda_ipc.py`): the newest
snapshot, and one serving thread per receiver group whose failure surfaces in the caller's thread;
`SnapshotSender` puts the two together behind publish / check / close.

    slot = SnapshotSlot(bucket_bytes=64 << 20)
    slot.publish(model.named_parameters(), version=3)      # trainer thread: packs, returns
    snapshot = slot.acquire(min_version=3, stop=stop)       # a serving thread: newest with version >= 3
    ...send snapshot.buckets...
    slot.release(snapshot)

    threads = ServingThreads("weight-sync", serve, ["rollout-0", "rollout-1"])  # serve(name, stop)
    threads.check()              # raises a failed thread's error, naming its group
    threads.close(timeout_s)     # stops and joins them

Only the newest snapshot is kept: `publish` packs into the newest snapshot's buckets in place
when no thread is sending it (no allocation), and into new buckets otherwise; a superseded
snapshot lives on only until the threads sending it release it. So the sender holds one copy of
the weights, two while a send overlaps a publish. Publish from one thread only. CUDA snapshots
become visible once their copies finished (publish waits for the current stream).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from stream_rlhf.telemetry import trace
from stream_rlhf.weights.buckets import BucketLayout, pack
from stream_rlhf.weights.group import ReceiverRestarted, WeightSyncClosed, WeightSyncTimeout, address_file

log = logging.getLogger(__name__)

WAKE_S = 0.1
"""How often waiting serving threads look at their stop event."""
CLOSE_WAIT_S = 10.0
"""The longest a closing sender waits for its groups' threads (see SnapshotSender.close)."""


@dataclass(frozen=True)
class Snapshot:
    version: int
    buckets: tuple[torch.Tensor, ...]


class SnapshotSlot:
    """The newest packed snapshot of a sender's weights, shared by its serving threads."""

    def __init__(self, bucket_bytes: int):
        self.bucket_bytes = bucket_bytes
        self.layout: BucketLayout | None = None
        """Fixed by the first publish: names, shapes and dtypes may not change after it."""
        self._cond = threading.Condition()
        self._newest: Snapshot | None = None
        self._last_version = -1
        self._readers: dict[int, int] = {}  # version -> serving threads sending it

    def publish(self, named: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Pack `named` as `version` (greater than the last), replacing the newest snapshot."""
        named = list(named)
        if not named:
            raise ValueError(f"publish(version={version}): no tensors")
        if version <= self._last_version:
            raise ValueError(f"publish(version={version}): versions must increase; "
                             f"the last published is {self._last_version}")
        if self.layout is None:
            self.layout = BucketLayout.of(named, self.bucket_bytes)
        with self._cond:  # a newest snapshot no thread is sending is overwritten in place
            old = self._newest
            reuse = old is not None and old.version not in self._readers
            if reuse:
                self._newest = None
        try:
            buckets = pack(named, self.layout, out=old.buckets if reuse else None)
        except ValueError as exc:  # raised before any copy: `old` is intact
            if reuse:
                with self._cond:
                    self._newest = old
            raise ValueError(f"publish(version={version}): {exc} (the first publish fixed the layout)") from None
        if buckets[0].is_cuda:  # serving threads send from other streams (NCCL) or processes (CUDA IPC)
            torch.cuda.current_stream(buckets[0].device).synchronize()
        with self._cond:
            self._newest = Snapshot(version, tuple(buckets))
            self._last_version = version
            self._cond.notify_all()

    def acquire(self, min_version: int, stop: threading.Event, unless: Callable[[], bool] | None = None) -> Snapshot:
        """The newest snapshot once its version is >= `min_version`; hold it until `release`.
        Raises WeightSyncClosed once `stop` is set, ReceiverRestarted once `unless()` is true."""
        with self._cond:
            while self._newest is None or self._newest.version < min_version:
                if stop.is_set():
                    raise WeightSyncClosed(f"closed while waiting for a version >= {min_version}")
                if unless is not None and unless():
                    raise ReceiverRestarted(f"a restarted receiver asked to join again (while waiting for a version "
                                            f">= {min_version})")
                self._cond.wait(WAKE_S)
            snapshot = self._newest
            self._readers[snapshot.version] = self._readers.get(snapshot.version, 0) + 1
            return snapshot

    def release(self, snapshot: Snapshot) -> None:
        """Done sending `snapshot`: once no thread holds it and it is not the newest, it is freed."""
        with self._cond:
            self._readers[snapshot.version] -= 1
            if self._readers[snapshot.version] == 0:
                del self._readers[snapshot.version]


class ServingThreads:
    """One daemon thread per group running `serve(name, stop)` until it returns, fails or `stop` is
    set. A failure is kept; `check()` raises it (every time) in the caller's thread, and `close()`
    raises one that `check()` never did."""

    def __init__(self, what: str, serve: Callable[[str, threading.Event], None], names: Iterable[str]):
        self.what = what
        self.stop = threading.Event()
        self._failures: dict[str, BaseException] = {}
        self._reported = False
        self._threads = [
            threading.Thread(target=self._run, args=(serve, name), name=f"{what} {name}", daemon=True)
            for name in names
        ]
        for thread in self._threads:
            thread.start()

    def _run(self, serve: Callable[[str, threading.Event], None], name: str) -> None:
        try:
            serve(name, self.stop)
        except WeightSyncClosed:
            pass
        except WeightSyncTimeout as exc:  # its message names the group already
            self._failures.setdefault(name, exc)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread by check()
            if not self.stop.is_set():  # errors while closing are the closing's doing
                failure = RuntimeError(f"{self.what} group {name!r}: serving thread failed: "
                                       f"{type(exc).__name__}: {exc}")
                failure.__cause__ = exc
                self._failures.setdefault(name, failure)

    def check(self) -> None:
        """Raise the first failure of a serving thread, if any."""
        failures = list(self._failures.values())
        if failures:
            self._reported = True
            raise failures[0]

    def close(self, timeout_s: float) -> None:
        """Stop every thread and wait up to `timeout_s` in all (a thread inside a rendezvous or a
        collective returns only when that ends or times out: one still there is left behind, it
        is a daemon, with a warning); raise a failure check() has not raised."""
        self.stop.set()
        deadline = time.monotonic() + timeout_s
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        if stuck := [t.name for t in self._threads if t.is_alive()]:
            log.warning("%s still inside a transfer %.0fs after closing: left behind (a receiver stopped mid-way?)",
                        ", ".join(stuck), timeout_s)
        if not self._reported:
            self.check()


class SnapshotSender:
    """A transport's trainer end: `publish` snapshots, and one thread per receiver group runs the
    transport's `_serve(name, stop)` (set every attribute `_serve` reads before calling this
    `__init__`: the threads start in it). Stale address files of the groups are removed first."""

    what = "weight-sync"
    """Names the serving threads and their failures."""

    def __init__(self, folder: Path, names: Iterable[str], bucket_bytes: int, timeout_s: float, host: str):
        self.folder = Path(folder)
        self.timeout_s = timeout_s
        self.host = host
        names = list(names)
        for name in names:
            address_file(self.folder, name).unlink(missing_ok=True)
        self._slot = SnapshotSlot(bucket_bytes)
        self._threads = ServingThreads(self.what, self._serve, names)

    def publish(self, named: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Snapshot `named` as `version` (greater than the last) for the groups' next requests;
        raises a group's failure first, if any."""
        self._threads.check()
        with trace.span("weights publish", "weights", version=version, transport=self.what):
            self._slot.publish(named, version)

    def check(self) -> None:
        """Raise the error of a group whose serving thread failed, if any."""
        self._threads.check()

    def close(self) -> None:
        """Stop serving; raises a failure not raised before. Returns at once unless a group's thread
        is inside a collective or waits for an acknowledgement (then within CLOSE_WAIT_S: a
        receiver still taking part finishes well within it, one that stopped would hold the
        closing trainer, at a drain past the launcher's grace, until the collective times out)."""
        self._threads.close(min(self.timeout_s + 5.0, CLOSE_WAIT_S))

    def _serve(self, name: str, stop: threading.Event) -> None:
        raise NotImplementedError
