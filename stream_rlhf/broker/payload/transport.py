"""Payload plane: where a handle's tensor bytes live and how a consumer gets them.

A producer `put`s the tensors of one handle and gets back the FieldSpecs to put in the handle; a
consumer `get`s tensors from a handle; the producer `release`s the payload once the broker says
every consumer acked. Two transports implement the PayloadTransport protocol:

    ShmTransport     same host: a POSIX shared-memory segment per handle (reused from a pool once
                     no consumer maps it), mapped zero-copy (copy-on-write) by consumers;
                     payloads up to 64 KiB go into slots of a shared arena and are copied out.
                     Other hosts: the producer's PayloadServer sends the same bytes as ZMQ frames
                     (zero-copy from the segment, one frame a field, at most FRAME_BYTES each).
    MemoryTransport  in-process: tensors kept in a dict, for stages run without sockets in tests
                     (`memory_transport.py`).

A GPU transport (CUDA IPC handles, NCCL p2p) implements the same protocol and adds its kind to
`messages.LocationKind`; every stage process of a job uses the transport the job is built with.

Same host or other host is decided by the host id each FieldSpec's location carries
(`shm.host_id()`: the machine's, or STREAM_RLHF_HOST_ID, which the Ray launcher sets per node with
`ray.node_hosts`). With a key folder the payload server is a CURVE server admitting the job's
clients and the fetch sockets its clients (`sockets.curve_server` / `curve_client`); without one
it binds loopback only.

The payload server (`server.py`) reads requests of at most REQUEST_BYTES: libzmq closes the
connection of a peer that sends a larger frame, and the server counts those (`connwatch.py`; a
consumer says goodbye with a FetchRequest without fields before it closes). A fetch socket takes
frames of at most FRAME_BYTES, and each must be as long as its field. The counters are the
transport's `counters` (rejections, `payload.fetched_tcp` and its bytes), which the stage runner
reports with its own; every fetch over TCP is also traced ("fetch tcp").
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Literal, Protocol

import torch
import zmq

from stream_rlhf.broker import sockets
from stream_rlhf.broker.control.messages import (
    FetchRequest,
    FieldAt,
    FieldSpec,
    Handle,
    Location,
    Reclaim,
    decode_fetch_reply,
    encode,
)
from stream_rlhf.broker.payload import shm
from stream_rlhf.broker.payload.host_server import HOST_SERVER_ENV
from stream_rlhf.broker.payload.server import GOODBYE, PayloadError, PayloadServer, ServedField
from stream_rlhf.broker.payload.shm import host_id
from stream_rlhf.telemetry import trace

log = logging.getLogger(__name__)

ALIGN = 64
MAX_ARENA_MAPS = 64  # small-payload arenas a consumer keeps mapped
FRAME_BYTES = 1 << 30
"""Largest field a consumer fetches from another host (one frame); a bigger one fails by name."""
Tensors = dict[str, torch.Tensor]
_SEGMENT_IDS = itertools.count()
"""Numbers the segments of every transport of this process (a device group runs several)."""


class PayloadTransport(Protocol):
    counters: dict[str, float]
    """What the transport counted (its payload server's rejections), keyed `payload.*`."""

    def put(self, handle_id: str, tensors: Tensors) -> dict[str, FieldSpec]: ...

    def get(self, handle: Handle) -> Tensors: ...

    def release(self, handle_id: str) -> None: ...

    def held(self) -> int:
        """Payloads put and not yet released."""
        ...

    def close(self) -> None: ...


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise PayloadError(f"unknown dtype {name!r}")
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def tensor_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of `tensor`'s data (made contiguous first; works for bf16 and scalars)."""
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def view_tensor(buffer, spec: FieldSpec, offset: int) -> torch.Tensor:
    """A tensor of `spec`'s dtype and shape over `buffer` at `offset`, without copying."""
    dtype = dtype_from_name(spec.dtype)
    if spec.nbytes == 0:
        return torch.empty(spec.shape, dtype=dtype)
    itemsize = torch.empty((), dtype=dtype).element_size()
    expected = itemsize * _numel(spec.shape)
    if expected != spec.nbytes:
        raise PayloadError(f"shape {spec.shape} of {spec.dtype} is {expected} bytes, spec says {spec.nbytes}")
    if offset + expected > len(buffer):
        raise PayloadError(f"{expected} bytes at offset {offset} run past the {len(buffer)} bytes of the payload")
    return torch.frombuffer(buffer, dtype=dtype, count=expected // itemsize, offset=offset).reshape(spec.shape)


def _numel(shape: list[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass
class Held:
    """A payload this producer holds until released: its segment, the fields' (offset, nbytes)
    in it, and for a small payload the offset of its slot in a SlotArena segment (else -1)."""

    segment: shm.Segment
    spans: dict[str, tuple[int, int]]
    slot_offset: int


class ShmTransport:
    """Shared memory on one host, served over TCP to others. One instance per process.

    prefer="tcp" makes a consumer fetch over TCP even from its own host (benchmarks, tests).
    serve: answer fetches from other hosts: with a payload server of this process's own, or, when
    the launcher named its host's (HOST_SERVER_ENV, `host_server.py`), with that one, which
    outlives the process (a consumer still gets what a producer that died had published).
    serve_host: interface the payload server binds for consumers on other hosts (beyond loopback
    only with `key_dir`).
    pool_bytes: released segments kept for reuse (0: a fresh segment for every handle).
    key_dir: the job's CURVE key folder: the server and the fetch sockets use it (None: plaintext).
    fetch_timeout_s: how long a fetch from another host waits for its payload server's answer.
    """

    def __init__(
        self,
        prefix: str = "srlhf",
        serve: bool = True,
        serve_host: str = "127.0.0.1",
        prefer: Literal["auto", "tcp"] = "auto",
        context: zmq.Context | None = None,
        pool_bytes: int = 512 << 20,
        key_dir: str | None = None,
        fetch_timeout_s: float = 30.0,
    ):
        self.prefix = prefix
        self.key_dir = key_dir
        self.fetch_timeout_s = fetch_timeout_s
        self.host = host_id()
        self.prefer = prefer
        # a CURVE server's authenticator is one per context: a transport with keys gets its own
        self._own_context = context is None and key_dir is not None
        self._context = context or (zmq.Context() if self._own_context else zmq.Context.instance())
        self._lock = threading.Lock()
        self._owned: dict[str, Held] = {}
        self._pool = shm.SegmentPool(pool_bytes)
        self._slots = shm.SlotArena(self._new_segment)
        self._arena_maps: OrderedDict[str, object] = OrderedDict()  # consumer side, small payloads
        self._fetch_sockets: dict[str, zmq.Socket] = {}
        self.counters: dict[str, float] = {}
        host_server = os.environ.get(HOST_SERVER_ENV) if serve else None
        own = serve and not host_server
        self._server = PayloadServer(self, self._context, serve_host, self.counters, key_dir) if own else None
        self.endpoint = host_server or (self._server.endpoint if self._server else "")

    def put(self, handle_id: str, tensors: Tensors) -> dict[str, FieldSpec]:
        layout, offset = [], 0
        for name, tensor in tensors.items():
            if not isinstance(tensor, torch.Tensor):
                raise PayloadError(f"handle {handle_id} field {name!r}: expected a tensor, got {type(tensor).__name__}")
            if tensor.device.type != "cpu":
                raise PayloadError(
                    f"handle {handle_id} field {name!r}: tensor on {tensor.device}; the shm transport "
                    "carries CPU tensors (a GPU transport implements PayloadTransport for CUDA)"
                )
            raw = tensor_bytes(tensor)
            layout.append((name, tensor, raw, offset))
            offset = _align(offset + raw.numel())
        if not layout:
            return {}  # a handle without tensors needs no segment
        small = offset <= shm.SlotArena.SLOT_BYTES
        with self._lock:
            if small:
                segment, base = self._slots.alloc()
            else:
                segment, base = self._pool.take(offset), 0
        if segment is None:
            segment = self._new_segment(offset)
        fields = {}
        for name, tensor, raw, field_offset in layout:
            if raw.numel():
                target = torch.frombuffer(segment.mapping, dtype=torch.uint8, count=raw.numel(),
                                          offset=base + field_offset)
                target.copy_(raw)
            fields[name] = FieldSpec(
                dtype=dtype_name(tensor.dtype),
                shape=list(tensor.shape),
                nbytes=raw.numel(),
                location=Location("shm", segment.name, base + field_offset, self.host, self.endpoint, small),
            )
        spans = {name: (spec.location.offset, spec.nbytes) for name, spec in fields.items()}
        with self._lock:
            self._owned[handle_id] = Held(segment, spans, base if small else -1)
        return fields

    def _new_segment(self, size: int) -> shm.Segment:
        return shm.create(shm.segment_name(self.prefix, os.getpid(), next(_SEGMENT_IDS)), size)

    def get(self, handle: Handle) -> Tensors:
        if not handle.fields:
            return {}
        first = next(iter(handle.fields.values())).location
        local = self.prefer == "auto" and first.host == self.host
        return self._map_local(handle) if local else self._fetch_remote(handle)

    def _map_local(self, handle: Handle) -> Tensors:
        mappings = {}
        out = {}
        for name, spec in handle.fields.items():
            segment = spec.location.segment
            try:
                if spec.location.copy_out:
                    tensor = view_tensor(self._arena_map(segment), spec, spec.location.offset).clone()
                else:
                    if segment not in mappings:
                        mappings[segment] = shm.attach(segment)
                    tensor = view_tensor(mappings[segment], spec, spec.location.offset)
            except FileNotFoundError:
                raise PayloadError(
                    f"handle {handle.id} field {name!r}: shared-memory segment {segment} is gone "
                    f"(producer {handle.producer or '?'} released or lost it)"
                ) from None
            except (OSError, ValueError, PayloadError) as exc:  # a bad name, a field past the segment...
                raise PayloadError(f"handle {handle.id} field {name!r}: segment {segment!r}: {exc}") from None
            out[name] = tensor
        return out

    def _arena_map(self, segment: str):
        mapping = self._arena_maps.get(segment)
        if mapping is None:
            mapping = self._arena_maps[segment] = shm.attach_cached(segment)
            if len(self._arena_maps) > MAX_ARENA_MAPS:
                self._arena_maps.popitem(last=False)
        return mapping

    def _fetch_remote(self, handle: Handle) -> Tensors:
        by_endpoint: dict[str, list[str]] = {}
        for name, spec in handle.fields.items():
            if spec.nbytes > FRAME_BYTES:
                raise PayloadError(f"handle {handle.id} field {name!r}: {spec.nbytes:,} bytes, over the "
                                   f"{FRAME_BYTES:,} a fetch from another host takes (payload.FRAME_BYTES)")
            by_endpoint.setdefault(spec.location.endpoint, []).append(name)
        out = {}
        started = trace.now_ns()
        for endpoint, names in by_endpoint.items():
            if not endpoint:
                raise PayloadError(f"handle {handle.id}: producer {handle.producer} serves no payload endpoint")
            sock = self._fetch_socket(endpoint)
            at = [FieldAt(spec.location.segment, spec.location.offset, spec.nbytes)
                  for spec in (handle.fields[name] for name in names)]
            sock.send(encode(FetchRequest(handle.id, names, at)))
            if not sock.poll(self.fetch_timeout_s * 1000):
                sock.close(linger=0)
                del self._fetch_sockets[endpoint]
                keys = " (are the CURVE keys right?)" if self.key_dir else ""
                raise PayloadError(f"handle {handle.id}: payload server {endpoint} did not answer in "
                                   f"{self.fetch_timeout_s:g} s{keys}")
            header, *frames = sock.recv_multipart(copy=False)
            reply = decode_fetch_reply(header.buffer)
            if reply.error:
                raise PayloadError(f"handle {handle.id}: {endpoint} answered: {reply.error}")
            if len(frames) != len(names):
                raise PayloadError(f"handle {handle.id}: {endpoint} sent {len(frames)} frames for {len(names)} fields")
            for name, frame in zip(names, frames, strict=True):
                if len(frame.buffer) != handle.fields[name].nbytes:
                    raise PayloadError(f"handle {handle.id} field {name!r}: {endpoint} sent {len(frame.buffer)} "
                                       f"bytes, the handle says {handle.fields[name].nbytes}")
                out[name] = view_tensor(frame.buffer, handle.fields[name], 0)
        nbytes = sum(spec.nbytes for spec in handle.fields.values())
        self.counters["payload.fetched_tcp"] = self.counters.get("payload.fetched_tcp", 0) + 1
        self.counters["payload.fetched_tcp_bytes"] = self.counters.get("payload.fetched_tcp_bytes", 0) + nbytes
        trace.complete("fetch tcp", "payload", started, trace.now_ns(), producer=handle.producer, bytes=nbytes)
        return out

    def _fetch_socket(self, endpoint: str) -> zmq.Socket:
        sock = self._fetch_sockets.get(endpoint)
        if sock is None:
            sock = self._context.socket(zmq.REQ)
            sock.maxmsgsize = FRAME_BYTES + sockets.ENVELOPE_BYTES
            sockets.curve_client(sock, endpoint, self.key_dir, "payload server")
            sock.connect(endpoint)
            self._fetch_sockets[endpoint] = sock
        return sock

    def reclaim(self, request: Reclaim) -> int:
        """Refused: only a host's payload server (`host_server.py`) unlinks for the broker."""
        raise PayloadError("this payload server holds one producer's payloads; the broker's Reclaim goes to a "
                           "host's payload server")

    def tidy(self) -> None:
        """Nothing to let go: the payload server holds no mapping of its own (it serves this
        transport's segments, which `release` and `close` unmap)."""

    def frames_for(self, request: FetchRequest) -> list[ServedField]:
        """Called by the payload server: each requested field's bytes and how to send them, found by
        where it sits (`request.at`: a joined handle's parts are held under their own ids) or by
        the handle's id and the field's name."""
        if request.at and len(request.at) != len(request.fields):
            raise PayloadError(f"handle {request.handle_id}: {len(request.at)} places for {len(request.fields)} fields")
        with self._lock:
            if request.at:
                found = [self._held_at(request.handle_id, name, at) for name, at in zip(request.fields, request.at)]
            else:
                held = self._owned.get(request.handle_id)
                if held is None:
                    raise PayloadError(f"handle {request.handle_id} is not held here (released or never put)")
                if missing := [name for name in request.fields if name not in held.spans]:
                    raise PayloadError(f"handle {request.handle_id} has no field {missing[0]!r}")
                found = [(held, *held.spans[name]) for name in request.fields]
        return [ServedField(memoryview(held.segment.mapping)[offset : offset + nbytes], held.slot_offset >= 0,
                            held.segment.trackers) for held, offset, nbytes in found]

    def _held_at(self, handle_id: str, name: str, at: FieldAt) -> tuple[Held, int, int]:
        """The payload held here with a field at `at`, and that field's (offset, nbytes)."""
        for held in self._owned.values():
            if held.segment.name == at.segment and (at.offset, at.nbytes) in held.spans.values():
                return held, at.offset, at.nbytes
        raise PayloadError(f"handle {handle_id} field {name!r}: nothing held here at {at.segment}+{at.offset} "
                           "(released or never put)")

    def release(self, handle_id: str) -> None:
        """Every consumer acked: the segment goes back to the pool (reused once no consumer
        maps it any more) or, past the pool's size, is unlinked."""
        with self._lock:
            held = self._owned.pop(handle_id, None)
            if held is None:
                return
            if held.slot_offset >= 0:
                self._slots.free(held.segment, held.slot_offset)
            else:
                self._pool.give(held.segment)

    def held(self) -> int:
        with self._lock:
            return len(self._owned)

    def close(self) -> None:
        """Unlink every segment still held (the broker reclaims published ones it still tracks)."""
        if self._server:
            self._server.stop()
        with self._lock:
            owned, self._owned = self._owned, {}
            for held in owned.values():
                if held.slot_offset < 0:
                    held.segment.destroy()
            self._pool.close()
            self._slots.close()
        self._arena_maps.clear()
        for sock in self._fetch_sockets.values():
            try:
                sock.send(encode(GOODBYE), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass  # never connected, or its last fetch failed midway: a dropped connection then
            sock.close(linger=100)
        self._fetch_sockets.clear()
        if self._own_context:
            self._context.term()
