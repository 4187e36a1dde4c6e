"""The broker process: one ROUTER socket around a BrokerCore, in a loop that fits on a screen.

    stream-rlhf broker configs/broker_demo.yaml      # or BrokerServer(topology, config).serve()

Every frame is size-checked and decoded here; a bad one is rejected with a logged reason and a
counter, never an exception out of the loop: a handler that raises (a broker bug) is counted in
`internal_errors` and answered as a rejection naming the message type. libzmq itself refuses a
frame far over `max_message_bytes` by closing its connection; `connwatch.py` counts those. Log
lines about peers are rate-limited (`ratelog.py`). On SIGINT/SIGTERM or Control(shutdown) the
stages are told to shut down (once the trainers caught up with each other: `catch_up.py`); the
loop stops once every stage instance has left (or `shutdown_grace_s` passed), then unlinks every
payload it still tracks and any segment of a dead process of this job. What producers gone from
another host left there, the broker asks that host's payload server to unlink (`reclaim.py`,
sent by a `RemoteReclaimer` off the loop).

With a trace started in this process (`telemetry/trace.py`), the loop samples every
QUEUE_SAMPLE_S the depth of each consumer queue (`queue <topic>><stage>`: handles waiting for
delivery), the joins waiting for parts and the policy version, and traces the values that changed.
"""

from __future__ import annotations

import logging
import signal
import threading
import time

import msgspec
import zmq

from stream_rlhf.broker import sockets
from stream_rlhf.broker.connwatch import ConnectionWatch
from stream_rlhf.broker.control.admission import Admission
from stream_rlhf.broker.control.core import BrokerCore
from stream_rlhf.broker.control.messages import Heartbeat, Message, MessageRejected, decode
from stream_rlhf.broker.control.topology import CONTROL_STAGE, BrokerConfig, Topology
from stream_rlhf.broker.payload import shm
from stream_rlhf.broker.payload.remote_reclaim import RemoteReclaimer
from stream_rlhf.broker.payload.shm import host_id
from stream_rlhf.telemetry import trace

log = logging.getLogger(__name__)

MAX_BATCH = 256  # socket messages read per loop turn before flushing
MAX_FRAMES = 64  # message frames in one socket message
QUEUE_SAMPLE_S = 0.1  # how often the traced queue depths are read


class BrokerServer:
    def __init__(
        self,
        topology: Topology,
        config: BrokerConfig,
        admission: Admission | None = None,
        shutdown_grace_s: float = 10.0,
    ):
        self.config = config
        self.shutdown_grace_s = shutdown_grace_s
        reclaimed = shm.sweep(config.shm_prefix)
        self.core = BrokerCore(topology, config, time.monotonic(), admission)
        self.core.host = host_id()
        self.core.stats["segments_reclaimed"] += reclaimed
        self._context = zmq.Context()
        key_dir = config.curve.key_dir if config.curve else None
        self._socket, self._auth = sockets.router(self._context, config.address, key_dir, config.max_message_bytes)
        self._reclaimer = RemoteReclaimer(self._context, key_dir, self.core.stats)
        self.address = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self._watch = ConnectionWatch(self._socket, f"broker {self.core.broker_id}", self._socket.maxmsgsize,
                                      "max_message_bytes", self.core.ratelog, self.core.stats)
        self._poller = zmq.Poller()
        self._poller.register(self._socket, zmq.POLLIN)
        self._poller.register(self._watch.monitor, zmq.POLLIN)
        self._stop = threading.Event()
        self._encoder = msgspec.msgpack.Encoder()
        self._next_sample = 0.0
        self._sampled: dict[str, int] = {}  # traced counter -> the value traced last
        log.info("broker %s listening on %s", self.core.broker_id, self.address)

    def request_stop(self) -> None:
        """First call (SIGINT/SIGTERM): tell every stage to shut down and stop once they have
        left (or shutdown_grace_s passed). Second call: stop now. Only flips state."""
        if self.core.stopping:
            self._stop.set()
        else:
            self.core.stopping = True

    def stop(self) -> None:
        """Stop the loop now (stages are not told)."""
        self._stop.set()

    def serve(self) -> dict[str, float]:
        """Run until stopped; returns the final counters."""
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                if signal.getsignal(sig) is not signal.SIG_IGN:  # launched stages leave Ctrl-C to the launcher
                    signal.signal(sig, lambda *_: self.request_stop())
        interval = self.config.heartbeat_interval_s
        next_tick = time.monotonic() + interval
        stopping_since = shutdown_since = None
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                self._poller.poll(max(0, int((next_tick - now) * 1000)) + 1)
                self._watch.collect()
                if self._read_batch():
                    self._watch.judge()
                now = time.monotonic()
                if now >= next_tick:
                    self._tick(now)
                    next_tick = now + interval
                self._send(self._flush())
                self._send_reclaims()
                if trace.enabled() and now >= self._next_sample:
                    self._next_sample = now + QUEUE_SAMPLE_S
                    self._trace_counters()
                if self.core.stopping:
                    if stopping_since is None:
                        stopping_since = now
                        self.core.begin_stop()
                    elif self.core.catching_up and now - stopping_since > self.config.stop_catch_up_s:
                        self.core.end_catch_up()
                    if shutdown_since is None and self.core.shutdown_sent:
                        shutdown_since = now
                    self._send(self._flush())
                    stages_left = [i for i in self.core.instances.values() if i.stage != CONTROL_STAGE]
                    if not stages_left or (shutdown_since is not None and now - shutdown_since > self.shutdown_grace_s):
                        break
        finally:
            self.close()
        return dict(self.core.stats)

    def _trace_counters(self) -> None:
        values = {f"queue {topic}>{stage}": len(queue) for (topic, stage), queue in self.core.queues.items()}
        values["joins waiting"] = len(self.core.partials)
        values["policy version"] = self.core.policy_version
        for name, value in values.items():
            if self._sampled.get(name) != value:
                self._sampled[name] = value
                trace.counter(name, value=value)

    def _read_batch(self) -> bool:
        """Read up to MAX_BATCH socket messages; each carries one or more message frames.
        Returns True once the socket is read dry."""
        now = time.monotonic()
        for _ in range(MAX_BATCH):
            try:
                frames = self._socket.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return True
            peer = frames[0].bytes
            if not 2 <= len(frames) <= MAX_FRAMES + 1:
                self.core.reject(peer, f"{len(frames) - 1} message frames, expected 1 to {MAX_FRAMES}", "malformed")
                continue
            for frame in frames[1:]:
                message = self._handle_frame(peer, frame.buffer, now)
                if isinstance(message, Heartbeat) and message.state == "stopped":
                    self._watch.goodbye(frame)
        return False

    def _handle_frame(self, peer: bytes, body: memoryview, now: float) -> Message | None:
        """Decode and handle one frame; returns the message, None if it was rejected unread."""
        if len(body) > self.config.max_message_bytes:
            self.core.reject(
                peer, f"message of {len(body)} bytes over the {self.config.max_message_bytes} limit", "oversize"
            )
            return None
        try:
            message = decode(body)
        except MessageRejected as exc:
            self.core.reject(peer, f"malformed message: {exc}", "malformed")
            return None
        try:
            self.core.handle(peer, message, now)
        except Exception as exc:  # noqa: BLE001 - a broker bug must not take every stage down with it
            self._internal_error(f"handling {type(message).__name__}", exc, peer)
        return message

    def _tick(self, now: float) -> None:
        try:
            self.core.tick(now)
        except Exception as exc:  # noqa: BLE001 - as in _handle_frame
            self._internal_error("in the heartbeat check", exc, None)

    def _flush(self) -> list[tuple[bytes, Message]]:
        try:
            return self.core.flush()
        except Exception as exc:  # noqa: BLE001 - as in _handle_frame
            self._internal_error("dispatching", exc, None)
            return []

    def _internal_error(self, where: str, exc: Exception, peer: bytes | None) -> None:
        """Counted in `internal_errors`, logged with its traceback (rate-limited), and answered
        to the peer whose message raised as a rejection naming the message type."""
        self.core.stats["internal_errors"] += 1
        self.core.ratelog.log(logging.ERROR, "internal_error", "internal error %s from %r: %s", where, peer, exc,
                              exc_info=exc)
        if peer is not None:
            self.core.reject(peer, f"internal error {where}: {type(exc).__name__}: {exc}", "internal_error")

    def _send(self, outgoing) -> None:
        """One multipart socket message per peer per loop turn, one frame per message."""
        batches: dict[bytes, list[bytes]] = {}
        for peer, message in outgoing:
            batches.setdefault(peer, []).append(self._encoder.encode(message))
        for peer, frames in batches.items():
            for start in range(0, len(frames), MAX_FRAMES):
                try:
                    self._socket.send_multipart([peer, *frames[start : start + MAX_FRAMES]], zmq.NOBLOCK)
                except zmq.Again:
                    self.core.stats["send_dropped"] += 1  # peer's queue full: it is gone or stuck
                except zmq.ZMQError as exc:
                    self.core.stats["send_dropped"] += 1
                    log.debug("send to %r failed: %s", peer, exc)

    def _send_reclaims(self) -> None:
        for endpoint, request in self.core.reclaims:
            self._reclaimer.send(endpoint, request)
        self.core.reclaims.clear()

    def close(self) -> None:
        left = self.core.close()
        self.core.stats["unacked_at_shutdown"] = left
        self.core.stats["segments_reclaimed"] += shm.sweep(self.config.shm_prefix)
        self._send_reclaims()
        self._reclaimer.stop()
        self._watch.close()
        self._socket.close(linger=0)
        if self._auth:
            self._auth.stop()
        self._context.term()
        log.info("broker stopped: %s", {k: v for k, v in sorted(self.core.stats.items()) if v})
