"""The producer's side of payloads across hosts: a ROUTER socket on its own thread that answers
FetchRequests with the bytes its source finds (`frames_for`): the payloads a transport holds
(`payload.ShmTransport`), or every segment of the job on the host (`host_server.py`), zero-copy
from their segments, one frame a field. A host's server also answers the broker's Reclaim requests
(`reclaim`: segments of producers gone from that host) with a ReclaimReply.

    server = PayloadServer(transport, context, host, counters, key_dir)   # ShmTransport makes it
    server.endpoint                                                      # "tcp://host:port", in each FieldSpec
    server.stop()

It reads requests of at most REQUEST_BYTES (libzmq drops the connection of a peer that sends more,
and `connwatch.py` counts it); a consumer says GOODBYE before it closes. A bad request is answered
with its reason, counted and logged (rate-limited); the server never stops on one. With a key folder
it is a CURVE server admitting the job's clients (`sockets.curve_server`).
"""

from __future__ import annotations

import logging
import threading
from typing import NamedTuple, Protocol

import zmq

from stream_rlhf.broker import sockets
from stream_rlhf.broker.connwatch import ConnectionWatch
from stream_rlhf.broker.control.messages import (
    FetchReply,
    FetchRequest,
    MessageRejected,
    Reclaim,
    ReclaimReply,
    decode_payload_request,
    encode,
)
from stream_rlhf.broker.ratelog import RateLimitedLog, truncate

log = logging.getLogger(__name__)

REQUEST_BYTES = 64 << 10
"""Largest fetch request the payload server reads (a handle id and its field names)."""
GOODBYE = FetchRequest("", [])
"""What a consumer sends its payload servers before it closes its connection to them."""


class PayloadError(RuntimeError):
    """A payload could not be stored or fetched; the message names the handle and field."""


class ServedField(NamedTuple):
    """One requested field's bytes, and how to send them."""

    view: memoryview
    copy: bool
    """Copy them into the message (a small payload's slot is reused once its handle is released)."""
    trackers: list | None
    """Zero-copy: where the send's MessageTracker goes (its segment's, not reused before it is
    done), or None when nothing reuses the memory."""


class PayloadSource(Protocol):
    def frames_for(self, request: FetchRequest) -> list[ServedField]:
        """Each requested field's bytes; PayloadError naming the handle and field if not found."""

    def reclaim(self, request: Reclaim) -> int:
        """Unlink what the broker names; the number of segments unlinked, or PayloadError."""

    def tidy(self) -> None:
        """Let go of what is no longer served; called each turn of the server's loop (~10 a second)."""


class PayloadServer:
    """A ROUTER socket on its own thread answering FetchRequests with what its source finds.
    A bad request is answered with its reason, counted in `counters` and logged (rate-limited)."""

    def __init__(self, source: PayloadSource, context: zmq.Context, host: str, counters: dict[str, float],
                 key_dir: str | None = None):
        self._source = source
        self._socket = context.socket(zmq.ROUTER)
        self._socket.linger = 0
        self._socket.maxmsgsize = REQUEST_BYTES
        self._auth = sockets.curve_server(context, self._socket, f"tcp://{host}:0", key_dir, "payload server")
        port = self._socket.bind_to_random_port(f"tcp://{host}")
        self.endpoint = f"tcp://{host}:{port}"
        self.counters = counters
        self._ratelog = RateLimitedLog(log)
        self._watch = ConnectionWatch(self._socket, f"payload server {self.endpoint}", REQUEST_BYTES,
                                      "payload_server.REQUEST_BYTES", self._ratelog, counters,
                                      "payload.connections_dropped")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="payload-server", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        poller.register(self._watch.monitor, zmq.POLLIN)
        while not self._stop.is_set():
            poller.poll(100)
            self._watch.collect()
            while self._socket.poll(0):
                message = self._socket.recv_multipart(copy=False)
                try:
                    self._answer(message)
                except Exception as exc:  # noqa: BLE001 - a bug must not stop the payload plane
                    self._reject("internal_error", f"{type(exc).__name__}: {exc}", None, FetchReply)
            self._source.tidy()
            self._watch.judge()
            self._ratelog.flush()
        self._watch.close()
        self._socket.close(linger=0)
        if self._auth is not None:
            self._auth.stop()

    def _answer(self, message: list[zmq.Frame]) -> None:
        if len(message) != 3:
            self._reject("malformed", f"{len(message)} frames, expected 3", None, FetchReply)
            return
        identity, empty, request_frame = message[0].bytes, b"", message[2]  # bytes: tracked sends take no Frames
        reply: type[FetchReply] | type[ReclaimReply] = FetchReply
        try:
            request = decode_payload_request(request_frame.buffer)
            if request == GOODBYE:
                self._watch.goodbye(request_frame)
                return
            if isinstance(request, Reclaim):
                reply = ReclaimReply
                unlinked = self._source.reclaim(request)
                self.counters["payload.reclaimed"] = self.counters.get("payload.reclaimed", 0) + unlinked
                self._socket.send_multipart([identity, empty, encode(ReclaimReply(unlinked))])
                return
            found = self._source.frames_for(request)
        except (MessageRejected, PayloadError) as exc:
            if isinstance(exc, MessageRejected):
                kind = "malformed"
            else:
                kind = "refused" if reply is ReclaimReply else "not_held"
            self._reject(kind, str(exc), [identity, empty], reply)
            return
        frames = [field.view for field in found]
        if any(field.copy for field in found):  # small payloads: copied, their slots free to reuse
            self._socket.send_multipart([identity, empty, encode(FetchReply()), *frames])
            return
        tracker = self._socket.send_multipart(
            [identity, empty, encode(FetchReply()), *frames], copy=False, track=True
        )
        for trackers in {id(f.trackers): f.trackers for f in found if f.trackers is not None}.values():
            trackers.append(tracker)  # not reused before zmq has sent these bytes

    def _reject(self, kind: str, reason: str, envelope: list[zmq.Frame] | None,
                reply: type[FetchReply] | type[ReclaimReply]) -> None:
        self.counters[f"payload.rejected.{kind}"] = self.counters.get(f"payload.rejected.{kind}", 0) + 1
        self._ratelog.log(logging.WARNING, kind, "payload request rejected (%s): %s", kind, reason)
        if envelope is not None:
            self._socket.send_multipart([*envelope, encode(reply(error=truncate(reason, 1000)))])

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
