"""One payload server per host for a job across hosts, serving the payloads of every process there.

    server = HostPayloadServer("srlhf", "10.0.0.5", key_dir)   # the Ray launcher: one a host (`launch/ray_hosts.py`)
    os.environ[HOST_SERVER_ENV] = server.endpoint              # each rank there: its payloads name this endpoint
    server.stop()

A producer's tensors stay in its host's shared memory (`shm.py`), and the segments outlive the
process. A payload server inside the producer (`server.py`) dies with it, though, and a consumer on
another host then waits `fetch_timeout_s` for an answer and drops the handle, which fails the job:
a restarted rollout or forward could not save it. This server lives as long as the job (in the
host's launcher actor) and answers by where the bytes sit (`FetchRequest.at`: segment, offset,
size), so a handle published by a process that died since is still served. It serves only
segments named with the job's prefix, mapped without the consumers' lock (`shm.attach_cached`:
it never holds a producer back from reusing a released segment, and a handle is released only
once every consumer, each of which has fetched it, acknowledged it), and keeps the newest
`MAPPINGS` mappings, dropping those of segments unlinked since within UNLINKED_CHECK_S, whether
requests come or not (their memory goes back).

The broker frees what producers gone from this host leave (`broker/control/reclaim.py`): it sends
a Reclaim naming the segments of acknowledged handles, or a dead process whose other segments go
(its pool, payloads it never published) but those live handles still point into. The server
unlinks only the job's segments, a dead process's only once it no longer runs on this host, and
drops its mappings of them, so their memory goes back at once.
"""

from __future__ import annotations

import mmap
import time
from collections import OrderedDict

import zmq

from stream_rlhf.broker.control.messages import FetchRequest, Reclaim
from stream_rlhf.broker.payload import shm
from stream_rlhf.broker.payload.server import PayloadError, PayloadServer, ServedField

HOST_SERVER_ENV = "STREAM_RLHF_HOST_PAYLOADS"
"""Set by the launcher for each rank: its host's payload server, named in the rank's payloads."""
MAPPINGS = 64
"""Segments the host's server keeps mapped (the least recently served are dropped first)."""
UNLINKED_CHECK_S = 1.0
"""How often the server drops its mappings of segments unlinked since (requests or none)."""


class HostSegments:
    """The bytes at each requested place, from the host's segments of one job (`prefix`)."""

    def __init__(self, prefix: str):
        self.prefix = prefix
        self._mappings: OrderedDict[str, mmap.mmap] = OrderedDict()
        self._checked_at = 0.0

    def frames_for(self, request: FetchRequest) -> list[ServedField]:
        if len(request.at) != len(request.fields):
            raise PayloadError(f"handle {request.handle_id}: the host's payload server serves fields by place; the "
                               f"request gives {len(request.at)} for {len(request.fields)} fields")
        found = []
        for name, at in zip(request.fields, request.at, strict=True):
            if not shm.has_prefix(at.segment, self.prefix):
                raise PayloadError(f"handle {request.handle_id} field {name!r}: segment {at.segment!r} is not one of "
                                   f"this job's ({self.prefix})")
            mapping = self._mapping(request.handle_id, name, at.segment)
            if at.offset + at.nbytes > len(mapping):
                raise PayloadError(f"handle {request.handle_id} field {name!r}: {at.nbytes} bytes at offset "
                                   f"{at.offset} run past the {len(mapping)} bytes of {at.segment}")
            # zero-copy: the message keeps the mapping alive however long zmq takes to send it
            found.append(ServedField(memoryview(mapping)[at.offset : at.offset + at.nbytes], False, None))
        return found

    def reclaim(self, request: Reclaim) -> int:
        """Unlink the job's segments `request` names, and a dead creator's other segments but those
        it keeps; returns how many were unlinked."""
        for segment in request.segments:
            if not shm.has_prefix(segment, self.prefix):
                raise PayloadError(f"segment {segment!r} is not one of this job's ({self.prefix})")
        doomed = set(request.segments)
        if request.dead_pid and not shm.pid_alive(request.dead_pid):  # one that runs (it reconnected) keeps them
            keep = set(request.keep)
            doomed |= {name for name, pid in shm.list_segments(self.prefix)
                       if pid == request.dead_pid and name not in keep}
        unlinked = 0
        for segment in doomed:
            self._mappings.pop(segment, None)  # a send in flight keeps its own view alive
            unlinked += shm.unlink(segment)
        return unlinked

    def tidy(self) -> None:
        """A mapping keeps its segment's memory after the producer unlinked it (its pool let it go,
        or it closed): drop those, every UNLINKED_CHECK_S at most (the server calls this between
        requests, and when none come)."""
        now = time.monotonic()
        if now - self._checked_at < UNLINKED_CHECK_S:
            return
        self._checked_at = now
        for segment in [s for s in self._mappings if not shm.exists(s)]:
            del self._mappings[segment]  # a send in flight keeps its own view alive

    def _mapping(self, handle_id: str, name: str, segment: str) -> mmap.mmap:
        mapping = self._mappings.pop(segment, None)
        if mapping is None:
            try:
                mapping = shm.attach_cached(segment)
            except FileNotFoundError:
                raise PayloadError(f"handle {handle_id} field {name!r}: segment {segment} is gone from this host "
                                   "(released or reclaimed)") from None
        self._mappings[segment] = mapping
        if len(self._mappings) > MAPPINGS:
            self._mappings.popitem(last=False)
        return mapping


class HostPayloadServer:
    """`HostSegments` of `prefix` behind a payload server on `host` (CURVE with `key_dir`)."""

    def __init__(self, prefix: str, host: str, key_dir: str | None):
        self.counters: dict[str, float] = {}
        self._context = zmq.Context()  # its own: a CURVE authenticator is one per context
        self._server = PayloadServer(HostSegments(prefix), self._context, host, self.counters, key_dir)
        self.endpoint = self._server.endpoint

    def stop(self) -> None:
        self._server.stop()
        self._context.term()
