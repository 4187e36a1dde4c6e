"""The broker's Reclaim requests to other hosts' payload servers, sent off the broker's loop.

    reclaimer = RemoteReclaimer(context, key_dir, stats)   # the broker server makes one
    reclaimer.send("tcp://10.0.0.6:5123", Reclaim(dead_pid=4242, keep=[...]))
    reclaimer.stop(drain_s=2.0)                             # at the broker's close

One thread sends the requests in order, one at a time, each on a REQ socket per server (CURVE with
the job's keys), and waits up to ANSWER_S for its ReclaimReply: the segments unlinked go into
`stats["segments_reclaimed_remote"]` (this thread is its only writer), a refusal or silence is
logged, and the request is not retried (what is left stays until the job ends, when the launcher
sweeps the host).
"""

from __future__ import annotations

import logging
import queue
import threading

import zmq

from stream_rlhf.broker import sockets
from stream_rlhf.broker.control.messages import MessageRejected, Reclaim, decode_reclaim_reply, encode

log = logging.getLogger(__name__)

ANSWER_S = 10.0
"""How long one request waits for its server's answer."""
REMOTE_COUNTER = "segments_reclaimed_remote"


class RemoteReclaimer:
    """Sends Reclaim requests to hosts' payload servers on its own thread."""

    def __init__(self, context: zmq.Context, key_dir: str | None, stats: dict[str, float]):
        self._context = context
        self._key_dir = key_dir
        self._stats = stats
        self._stats.setdefault(REMOTE_COUNTER, 0)  # set before the thread adds to it: no new key while read
        self._requests: queue.Queue[tuple[str, Reclaim] | None] = queue.Queue()
        self._sockets: dict[str, zmq.Socket] = {}
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="remote-reclaim", daemon=True)
        self._thread.start()

    def send(self, endpoint: str, request: Reclaim) -> None:
        self._requests.put((endpoint, request))

    def stop(self, drain_s: float = 2.0) -> None:
        """Send what is queued for at most `drain_s`, then close."""
        self._requests.put(None)
        self._thread.join(drain_s)
        if self._thread.is_alive():
            self._closed = True  # the broker terminates the context next: the thread then ends quietly
            log.warning("reclaim requests to other hosts not answered within %g s are dropped: their segments stay "
                        "until the job ends", drain_s)

    def _run(self) -> None:
        try:
            while (item := self._requests.get()) is not None:
                if not self._closed:
                    self._ask(*item)
        finally:
            for sock in self._sockets.values():
                sock.close(linger=0)

    def _ask(self, endpoint: str, request: Reclaim) -> None:
        try:
            sock = self._socket(endpoint)
            sock.send(encode(request))
            answered = sock.poll(ANSWER_S * 1000)
            reply = decode_reclaim_reply(sock.recv()) if answered else None
        except (sockets.CurveKeyError, zmq.ZMQError, MessageRejected) as exc:  # a bad address, keys, reply
            if not self._closed:
                log.warning("cannot ask %s to reclaim segments: %s", endpoint, exc)
            self._drop(endpoint)
            return
        if reply is None:
            log.warning("payload server %s did not answer a reclaim in %g s: its segments stay until the job ends",
                        endpoint, ANSWER_S)
            self._drop(endpoint)
            return
        if reply.error:
            log.warning("payload server %s refused a reclaim: %s", endpoint, reply.error)
        self._stats[REMOTE_COUNTER] += reply.unlinked

    def _socket(self, endpoint: str) -> zmq.Socket:
        sock = self._sockets.get(endpoint)
        if sock is None:
            sock = self._context.socket(zmq.REQ)
            sock.linger = 0
            sockets.curve_client(sock, endpoint, self._key_dir, "payload server")
            self._sockets[endpoint] = sock
            sock.connect(endpoint)
        return sock

    def _drop(self, endpoint: str) -> None:
        """Close the socket to `endpoint` (a REQ left waiting for an answer takes no new request)."""
        sock = self._sockets.pop(endpoint, None)
        if sock is not None:
            sock.close(linger=0)
