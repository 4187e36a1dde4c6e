"""Versioned weight updates through CUDA IPC, for a trainer and rollout instances sharing one GPU.

    # trainer: one receiver per name, each in its own process on the same GPU
    sender = CudaIpcSender(folder, ["rollout-0"], bucket_bytes=256 << 20, timeout_s=60.0)
    sender.publish(model.named_parameters(), version=3)   # CUDA tensors; packed on the GPU
    sender.close()

    receiver = CudaIpcReceiver.join(folder, "rollout-0", timeout_s=60.0, device="cuda:0")
    version, named = receiver.receive(min_version=3)      # copies in the receiver's own buffers
    receiver.close()

Same request / reply protocol as `broadcast.py` over a TCPStore hosted by the sender's thread
for each receiver (`group.rendezvous`, world size 2), but the reply carries CUDA IPC handles of
the snapshot's buckets instead of a broadcast. The receiver opens them on its device, copies each
bucket into buffers of its own (a few large device-to-device copies), waits for the copies and
acknowledges; until the ack the sender keeps the snapshot alive. The returned tensors are views
into the receiver's buffers, valid until the next receive() overwrites them in place.

Handles are plain JSON, not pickles: `export_bucket` turns torch's `reduce_tensor` arguments
(for a uint8 bucket) into a record of ints, bools and base64 bytes, and `rebuild_bucket` feeds
them back to torch's `rebuild_cuda_tensor` with the receiver's device index (the same physical
GPU, whatever CUDA_VISIBLE_DEVICES numbers it).
"""

from __future__ import annotations

import base64
import inspect
import itertools
import json
import threading
import time
from collections.abc import Iterable, Sequence
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

from stream_rlhf.telemetry import trace
from stream_rlhf.weights.buckets import BucketLayout, empty_buckets, unpack
from stream_rlhf.weights.group import address_file, publish_address, rendezvous, wait_for_address, wait_for_keys
from stream_rlhf.weights.sender import SnapshotSender

SENDER_NAME = "trainer (CUDA IPC sender)"
FIXED = {"tensor_cls": torch.Tensor, "storage_cls": torch.storage.TypedStorage, "dtype": torch.uint8}
"""rebuild_cuda_tensor arguments that are the same for every bucket: not sent."""
REBUILD_PARAMETERS = tuple(inspect.signature(rebuild_cuda_tensor).parameters)
BYTES_FIELDS = ("storage_handle", "ref_counter_handle", "event_handle")


def require_cuda(who: str) -> None:
    if not torch.cuda.is_available():
        raise RuntimeError(f"{who}: CUDA IPC needs a CUDA device; torch.cuda.is_available() is False "
                           f"(torch {torch.__version__}); use the broadcast (gloo) or shm transport")


def export_bucket(bucket: torch.Tensor) -> dict:
    """A JSON-able record of a CUDA uint8 bucket's IPC handle (see `handle_record`)."""
    _, args = reduce_tensor(bucket)
    return handle_record(args)


def handle_record(args: tuple) -> dict:
    """`reduce_tensor`'s arguments for rebuild_cuda_tensor as a record: ints, bools, base64 bytes."""
    if len(args) != len(REBUILD_PARAMETERS):
        raise RuntimeError(f"CUDA IPC: reduce_tensor gave {len(args)} arguments; torch {torch.__version__}'s "
                           f"rebuild_cuda_tensor takes {REBUILD_PARAMETERS}")
    named = dict(zip(REBUILD_PARAMETERS, args))
    for key, expected in FIXED.items():
        if named[key] is not expected:
            raise ValueError(f"CUDA IPC: {key}={named[key]!r}: buckets must have {expected!r}")
    if named["requires_grad"]:
        raise ValueError("CUDA IPC: a bucket that requires grad")
    record = {}
    for key, value in named.items():
        if key in FIXED:
            continue
        if key in BYTES_FIELDS:
            value = None if value is None else base64.b64encode(value).decode()
        elif isinstance(value, tuple):  # torch.Size included
            value = list(value)
        record[key] = value
    return record


def rebuild_args(record: dict, device_index: int) -> dict:
    """`handle_record`'s record back to rebuild_cuda_tensor's keyword arguments, on `device_index`."""
    expected = set(REBUILD_PARAMETERS) - set(FIXED)
    if record.keys() != expected:
        raise ValueError(f"CUDA IPC handle record: fields {sorted(record)}; expected {sorted(expected)}")
    kwargs = {**FIXED, **record, "storage_device": device_index,
              "tensor_size": torch.Size(record["tensor_size"]), "tensor_stride": tuple(record["tensor_stride"])}
    for key in BYTES_FIELDS:
        kwargs[key] = None if record[key] is None else base64.b64decode(record[key])
    return kwargs


def rebuild_bucket(record: dict, device: torch.device) -> torch.Tensor:
    """Open a bucket another process exported with `export_bucket` (shares its memory: no copy)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return rebuild_cuda_tensor(**rebuild_args(record, index))


class CudaIpcSender(SnapshotSender):
    """The trainer's end: one serving thread per receiver name (see the module docstring)."""

    what = "cuda-ipc"

    def __init__(self, folder: Path, receivers: Sequence[str], bucket_bytes: int, timeout_s: float,
                 host: str = "127.0.0.1"):
        require_cuda("CudaIpcSender")
        if not receivers:
            raise ValueError("CudaIpcSender: no receivers")
        super().__init__(folder, receivers, bucket_bytes, timeout_s, host)

    def publish(self, named: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Snapshot `named` (CUDA tensors) as `version` (greater than the last) on their GPU."""
        named = list(named)
        for name, tensor in named:
            if not tensor.is_cuda:
                raise ValueError(f"CudaIpcSender.publish: tensor {name!r} is on {tensor.device}, not a CUDA device")
        super().publish(named, version)

    def _serve(self, name: str, stop: threading.Event) -> None:
        try:
            store, _ = rendezvous(f"{self.host}:0", 0, 2, self.timeout_s, [SENDER_NAME, f"{name} receiver"], name,
                                  announce=partial(publish_address, self.folder, name), stop=stop)
            for request in itertools.count(1):
                self._answer(store, name, request, stop)
        finally:
            address_file(self.folder, name).unlink(missing_ok=True)

    def _answer(self, store: dist.Store, name: str, request: int, stop: threading.Event) -> None:
        wait_for_keys(store, [f"request/{request}"], f"cuda-ipc receiver {name!r}", stop=stop)
        min_version = int(store.get(f"request/{request}"))
        snapshot = self._slot.acquire(min_version, stop)
        try:
            if request == 1:
                store.set("layout", self._slot.layout.to_json())
            handles = [export_bucket(bucket) for bucket in snapshot.buckets]
            store.set(f"reply/{request}", json.dumps({"version": snapshot.version, "buckets": handles}))
            wait_for_keys(store, [f"ack/{request}"], f"cuda-ipc receiver {name!r} did not acknowledge version "
                          f"{snapshot.version} within {self.timeout_s}s", time.monotonic() + self.timeout_s, stop)
        finally:
            self._slot.release(snapshot)
        for key in (f"request/{request}", f"reply/{request}", f"ack/{request}"):
            store.delete_key(key)


class CudaIpcReceiver:
    """A rollout instance's end on the sender's GPU; make it with `join`."""

    def __init__(self, store: dist.Store, name: str, address: str, device: torch.device):
        self._store: dist.Store | None = store
        self.name = name
        self.address = address
        self.device = device
        self._requests = 0
        self._layout: BucketLayout | None = None
        self._buckets: list[torch.Tensor] = []

    @classmethod
    def join(cls, folder: Path, name: str, timeout_s: float, device: torch.device | str = "cuda") -> CudaIpcReceiver:
        """Wait (up to `timeout_s`) for the sender's address for `name` in `folder` and connect."""
        require_cuda("CudaIpcReceiver")
        device = torch.device(device)
        if device.type != "cuda":
            raise ValueError(f"CudaIpcReceiver {name!r}: device={device}: must be a CUDA device")
        address = wait_for_address(folder, name, timeout_s)
        store, address = rendezvous(address, 1, 2, timeout_s, [SENDER_NAME, f"{name} receiver"], name)
        return cls(store, name, address, device)

    def receive(self, min_version: int = 0,
                stop: threading.Event | None = None) -> tuple[int, list[tuple[str, torch.Tensor]]]:
        """The newest weights with a version >= `min_version`, waiting for them (as long as the
        sender is alive): (version, [(name, tensor)]), views into this receiver's buffers that the
        next receive() overwrites. Once `stop` is set before the sender replied, raises
        WeightSyncClosed (the receiver is then out of step with its sender: close it)."""
        where = f"cuda-ipc receiver {self.name!r} at {self.address}"
        if self._store is None:
            raise RuntimeError(f"{where}: receive after close()")
        self._requests += 1
        request, store = self._requests, self._store
        try:
            store.set(f"request/{request}", str(min_version))
            wait_for_keys(store, [f"reply/{request}"], where, stop=stop)
            reply = json.loads(store.get(f"reply/{request}"))
            if self._layout is None:
                self._layout = BucketLayout.from_json(store.get("layout").decode())
                self._buckets = empty_buckets(self._layout, self.device)
        except dist.DistError as exc:
            raise RuntimeError(f"{where}: lost the sender's store while waiting for version >= {min_version}: "
                               f"{exc}") from exc
        with trace.span("weights receive", "weights", version=reply["version"], group=self.name, transport="cuda_ipc"):
            shared = [rebuild_bucket(record, self.device) for record in reply["buckets"]]
            for mine, theirs in zip(self._buckets, shared, strict=True):
                mine.copy_(theirs)
            torch.cuda.current_stream(self.device).synchronize()
        del shared  # before the ack: the sender may free or reuse its buckets after it
        store.set(f"ack/{request}", "1")
        return reply["version"], unpack(self._buckets, self._layout)

    def close(self) -> None:
        """Drop the connection to the sender's store."""
        self._store = None
