"""Payload plane: where a handle's tensor bytes live and how a consumer gets them.

A producer `put`s the tensors of one handle and gets back the FieldSpecs to put in the handle; a
consumer `get`s tensors from a handle; the producer `release`s the payload once the broker says
every consumer acked. Transports (one table, chosen by name):

    shm     same host: one POSIX shared-memory segment per handle, mapped zero-copy
            (copy-on-write) by consumers; other hosts: the producer's PayloadServer sends the
            same mapped bytes as zero-copy ZMQ frames.
    memory  in-process: tensors kept in a dict, for stages run without sockets in tests.

A GPU transport (CUDA IPC handles, NCCL p2p) implements the same PayloadTransport protocol and
adds its kind to `messages.LocationKind`; consumers pick a transport by `Location.kind`.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
from typing import Literal, Protocol

import torch
import zmq

from stream_rlhf.broker import shm
from stream_rlhf.broker.shm import host_id
from stream_rlhf.broker.messages import (
    FetchReply,
    FetchRequest,
    FieldSpec,
    Handle,
    Location,
    MessageRejected,
    decode_fetch_reply,
    decode_fetch_request,
    encode,
)

log = logging.getLogger(__name__)

ALIGN = 64
Tensors = dict[str, torch.Tensor]


class PayloadError(RuntimeError):
    """A payload could not be stored or fetched; the message names the handle and field."""


class PayloadTransport(Protocol):
    def put(self, handle_id: str, tensors: Tensors) -> dict[str, FieldSpec]: ...

    def get(self, handle: Handle) -> Tensors: ...

    def release(self, handle_id: str) -> None: ...

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
    return torch.frombuffer(buffer, dtype=dtype, count=expected // itemsize, offset=offset).reshape(spec.shape)


def _numel(shape: list[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class ShmTransport:
    """Shared memory on one host, served over TCP to others. One instance per process.

    prefer="tcp" makes a consumer fetch over TCP even from its own host (benchmarks, tests).
    serve_host: interface the payload server binds for consumers on other hosts.
    """

    def __init__(
        self,
        prefix: str = "srlhf",
        serve: bool = True,
        serve_host: str = "127.0.0.1",
        prefer: Literal["auto", "tcp"] = "auto",
        context: zmq.Context | None = None,
    ):
        self.prefix = prefix
        self.host = host_id()
        self.prefer = prefer
        self._context = context or zmq.Context.instance()
        self._counter = itertools.count()
        self._lock = threading.Lock()
        # handle id -> (segment, mmap, {field: (offset, nbytes)})
        self._owned: dict[str, tuple[str, object, dict[str, tuple[int, int]]]] = {}
        self._fetch_sockets: dict[str, zmq.Socket] = {}
        self._server = PayloadServer(self, self._context, serve_host) if serve else None
        self.endpoint = self._server.endpoint if self._server else ""

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
        segment = shm.segment_name(self.prefix, os.getpid(), next(self._counter))
        mapping = shm.create(segment, offset)
        fields = {}
        for name, tensor, raw, field_offset in layout:
            if raw.numel():
                torch.frombuffer(mapping, dtype=torch.uint8, count=raw.numel(), offset=field_offset).copy_(raw)
            fields[name] = FieldSpec(
                dtype=dtype_name(tensor.dtype),
                shape=list(tensor.shape),
                nbytes=raw.numel(),
                location=Location("shm", segment, field_offset, self.host, self.endpoint),
            )
        spans = {name: (spec.location.offset, spec.nbytes) for name, spec in fields.items()}
        with self._lock:
            self._owned[handle_id] = (segment, mapping, spans)
        return fields

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
            if segment not in mappings:
                try:
                    mappings[segment] = shm.attach(segment)
                except FileNotFoundError:
                    raise PayloadError(
                        f"handle {handle.id} field {name!r}: shared-memory segment {segment} is gone "
                        f"(producer {handle.producer or '?'} released or lost it)"
                    ) from None
            out[name] = view_tensor(mappings[segment], spec, spec.location.offset)
        return out

    def _fetch_remote(self, handle: Handle) -> Tensors:
        by_endpoint: dict[str, list[str]] = {}
        for name, spec in handle.fields.items():
            by_endpoint.setdefault(spec.location.endpoint, []).append(name)
        out = {}
        for endpoint, names in by_endpoint.items():
            if not endpoint:
                raise PayloadError(f"handle {handle.id}: producer {handle.producer} serves no payload endpoint")
            sock = self._fetch_socket(endpoint)
            sock.send(encode(FetchRequest(handle.id, names)))
            if not sock.poll(30_000):
                sock.close(linger=0)
                del self._fetch_sockets[endpoint]
                raise PayloadError(f"handle {handle.id}: payload server {endpoint} did not answer in 30 s")
            header, *frames = sock.recv_multipart(copy=False)
            reply = decode_fetch_reply(header.buffer)
            if reply.error:
                raise PayloadError(f"handle {handle.id}: {endpoint} answered: {reply.error}")
            for name, frame in zip(names, frames):
                out[name] = view_tensor(frame.buffer, handle.fields[name], 0)
        return out

    def _fetch_socket(self, endpoint: str) -> zmq.Socket:
        sock = self._fetch_sockets.get(endpoint)
        if sock is None:
            sock = self._context.socket(zmq.REQ)
            sock.connect(endpoint)
            self._fetch_sockets[endpoint] = sock
        return sock

    def frames_for(self, handle_id: str, names: list[str]) -> list[memoryview]:
        """Called by the payload server: zero-copy views of the requested fields."""
        with self._lock:
            owned = self._owned.get(handle_id)
        if owned is None:
            raise PayloadError(f"handle {handle_id} is not held here (released or never put)")
        _, mapping, spans = owned
        view = memoryview(mapping)
        frames = []
        for name in names:
            if name not in spans:
                raise PayloadError(f"handle {handle_id} has no field {name!r}")
            offset, nbytes = spans[name]
            frames.append(view[offset : offset + nbytes])
        return frames

    def release(self, handle_id: str) -> None:
        with self._lock:
            owned = self._owned.pop(handle_id, None)
        if owned is not None:
            shm.unlink(owned[0])  # open mappings (consumers, in-flight frames) stay valid

    def held(self) -> int:
        with self._lock:
            return len(self._owned)

    def close(self) -> None:
        """Unlink every segment still held (the broker reclaims published ones it still tracks)."""
        if self._server:
            self._server.stop()
        with self._lock:
            owned, self._owned = self._owned, {}
        for segment, _, _ in owned.values():
            shm.unlink(segment)
        for sock in self._fetch_sockets.values():
            sock.close(linger=0)
        self._fetch_sockets.clear()


class PayloadServer:
    """A ROUTER socket on its own thread answering FetchRequests from the transport's segments."""

    def __init__(self, transport: ShmTransport, context: zmq.Context, host: str):
        self._transport = transport
        self._socket = context.socket(zmq.ROUTER)
        self._socket.linger = 0
        port = self._socket.bind_to_random_port(f"tcp://{host}")
        self.endpoint = f"tcp://{host}:{port}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="payload-server", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self._socket.poll(100):
                continue
            message = self._socket.recv_multipart()
            if len(message) != 3:
                log.warning("payload fetch rejected: %d frames, expected 3", len(message))
                continue
            identity, empty, request_frame = message
            try:
                request = decode_fetch_request(request_frame)
                frames = self._transport.frames_for(request.handle_id, request.fields)
            except (MessageRejected, PayloadError) as exc:
                log.warning("payload fetch rejected: %s", exc)
                self._socket.send_multipart([identity, empty, encode(FetchReply(error=str(exc)))])
                continue
            self._socket.send_multipart([identity, empty, encode(FetchReply()), *frames], copy=False)
        self._socket.close(linger=0)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)


class MemoryTransport:
    """In-process payloads: tensors stay in a dict shared by every stage of one process.
    A field's location is "{handle id}/{field}", so a joined handle may rename fields."""

    def __init__(self):
        self._store: dict[str, torch.Tensor] = {}
        self._keys: dict[str, list[str]] = {}

    def put(self, handle_id: str, tensors: Tensors) -> dict[str, FieldSpec]:
        keys = self._keys.setdefault(handle_id, [])
        fields = {}
        for name, tensor in tensors.items():
            key = f"{handle_id}/{name}"
            self._store[key] = tensor
            keys.append(key)
            nbytes = tensor.numel() * tensor.element_size()
            fields[name] = FieldSpec(dtype_name(tensor.dtype), list(tensor.shape), nbytes, Location("memory", key))
        return fields

    def get(self, handle: Handle) -> Tensors:
        out = {}
        for name, spec in handle.fields.items():
            tensor = self._store.get(spec.location.segment)
            if tensor is None:
                raise PayloadError(f"handle {handle.id} field {name!r}: payload {spec.location.segment} released")
            out[name] = tensor
        return out

    def release(self, handle_id: str) -> None:
        for key in self._keys.pop(handle_id, []):
            del self._store[key]

    def held(self) -> int:
        return len(self._keys)

    def close(self) -> None:
        self._store.clear()
        self._keys.clear()
