"""Runs one stage instance as a process attached to the broker: sockets, threads, shutdown.

    StageRunner(MyStage(), "rollout", "rollout-0", "tcp://127.0.0.1:5555").run()

Threads:
    io thread     owns the DEALER socket: handshake, heartbeats, credits, publish confirmations,
                  payload releases; queues Deliver/Control for the stage thread
    stage thread  (the caller of run()) calls the stage through a StageHost; it sends by writing
                  encoded frames to an inproc pipe that the io thread forwards to the broker

A stage instance of several ranks (`stream_rlhf/distributed.py`) runs this on its leader only: after the
handshake it shares GroupSetup with the other ranks, then every handle it fetches (GroupBatch,
then a barrier, so that the others have fetched it before it is acked), every weights_ready
(GroupWeights), and GroupStop when it stops (`group_follower.py` is the other ranks' side).

Shutdown is a state machine, and signals only flip the state:
    RUNNING --SIGTERM/SIGINT, Control(drain|shutdown), source exhausted--> DRAINING
    DRAINING: no new credit; deliveries not yet started are nacked back to the broker; inputs in
              flight (a stage with several, `Stage.inputs_in_flight`) are advanced to their end; waits for
              every publish to be confirmed and (up to drain_timeout_s, or until a shutdown for an
              exhausted source) every payload released
    DRAINING --drained, or a second signal--> STOPPED: final heartbeat says "stopped", so the
              broker takes over the payloads it still tracks
"""

from __future__ import annotations

import contextlib
import enum
import itertools
import logging
import os
import queue
import signal
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import msgspec
import zmq

from stream_rlhf.broker import sockets
from stream_rlhf.broker.control.client import HandshakeError
from stream_rlhf.broker.control.messages import (
    SCHEMA_VERSION,
    Ack,
    Control,
    ControlOp,
    Deliver,
    Error,
    GroupBatch,
    GroupSetup,
    GroupStop,
    GroupWeights,
    Handle,
    Heartbeat,
    Hello,
    Message,
    MessageRejected,
    Ready,
    Release,
    Request,
    Stats,
    decode,
)
from stream_rlhf.broker.payload.host_server import HOST_SERVER_ENV
from stream_rlhf.broker.payload.shm import host_id
from stream_rlhf.broker.payload.transport import PayloadTransport, ShmTransport
from stream_rlhf.broker.runtime.host import StageHost
from stream_rlhf.broker.runtime.in_flight import inputs_in_flight
from stream_rlhf.distributed import RankGroup
from stream_rlhf.stage import Batch, Stage, StageContext, StepAborted
from stream_rlhf.telemetry import trace

log = logging.getLogger(__name__)
_pipe_ids = itertools.count()
MAX_FRAMES_PER_SEND = 64


class RunnerState(enum.Enum):
    RUNNING = "running"
    DRAINING = "draining"
    STOPPED = "stopped"


class StageRunner:
    def __init__(
        self,
        stage: Stage,
        stage_name: str,
        instance_id: str,
        broker_address: str,
        key_dir: str | None = None,
        transport: PayloadTransport | None = None,
        prefetch: int = 2,
        handshake_timeout_s: float = 10.0,
        drain_timeout_s: float = 30.0,
        capabilities: list[str] = (),
        shm_prefix: str = "srlhf",
        group: RankGroup | None = None,
        step_context: Callable[[Batch | None], AbstractContextManager[None]] = nullcontext,
        setup_context: Callable[[], AbstractContextManager[None]] = nullcontext,
    ):
        """`step_context(batch)` wraps every step and `setup_context()` the stage's setup (core
        lending, offload policies: `launch/rank.py`)."""
        self.stage = stage
        self.setup_context = setup_context
        self.group = group or RankGroup.single()
        self._group_stopped = not self.group.distributed
        self.stage_name = stage_name
        self.instance_id = instance_id
        self.broker_address = broker_address
        self.key_dir = key_dir
        self.handshake_timeout_s = handshake_timeout_s
        self.drain_timeout_s = drain_timeout_s
        self.capabilities = list(capabilities)
        self.state = RunnerState.RUNNING
        self.paused = False
        self._context = zmq.Context()
        self.transport = transport or ShmTransport(prefix=shm_prefix, context=self._context, key_dir=key_dir,
                                                   serve_host=sockets.interface_towards(broker_address))
        self.host = StageHost(stage, stage_name, instance_id, self.transport, self._send, prefetch,
                              before_step=self._share_batch if self.group.distributed else None,
                              step_context=step_context)
        # Deliver / Control for the stage thread; None only wakes it (new producer credit)
        self._inbox: queue.SimpleQueue[Deliver | Control | None] = queue.SimpleQueue()
        self._ready = threading.Event()
        self._fatal: str | None = None
        self._set_up = False  # the stage's setup() returned (see _close_stage)
        self._io_stop = threading.Event()
        self._pipe_address = f"inproc://runner-{next(_pipe_ids)}"
        self._pipe_in = self._context.socket(zmq.PAIR)
        self._pipe_in.bind(self._pipe_address)
        self._pipe_out = self._context.socket(zmq.PAIR)
        self._pipe_out.connect(self._pipe_address)
        self._pipe_out_lock = threading.Lock()
        """The stage thread and a stage's own threads (a background weights publish) send through the pipe."""
        self._encoder = msgspec.msgpack.Encoder()
        self._io_thread = threading.Thread(target=self._io_loop, name=f"{instance_id}-io", daemon=True)
        self._heartbeat_interval = 0.5
        self._drain_started = 0.0
        self._last_hello = -1e9
        self._wait_for_releases = True
        self._announced = RunnerState.RUNNING
        self.log = logging.LoggerAdapter(log, {"stage": instance_id})

    # ---- stage thread ----------------------------------------------------------------------

    def run(self) -> dict[str, float]:
        """Run until STOPPED; returns the instance's counters. Raises what the stage raised."""
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                if signal.getsignal(sig) is not signal.SIG_IGN:  # launched stages leave Ctrl-C to the launcher
                    signal.signal(sig, lambda *_: self.request_stop())
        self._io_thread.start()
        try:
            self._await_handshake()
            self.group.share(GroupSetup(self.host.inputs, self.host.outputs))
            with trace.span("setup", "stage", stage=self.stage_name), self.setup_context():
                self.stage.setup(
                    StageContext(self.stage_name, self.instance_id, self.host.inputs, self.host.outputs,
                                 self._send_control, self.log, self.host.abort, self.group)
                )
            self._set_up = True
            self.host.allow_in_flight(inputs_in_flight(self.stage, self.stage_name, self.group.world_size))
            self.host.mark_idle()
            while self.state is not RunnerState.STOPPED:
                self._turn()
            # only after a clean stop: after a failure the other ranks may be waiting in one of the
            # step's collectives, and they fail by themselves once this process is gone
            self._stop_group()
        except StepAborted as exc:
            self.log.warning("%s", exc)
        finally:
            self._shutdown()
        return dict(self.host.counters)

    def _close_stage(self) -> None:
        """The stage's close(); after a setup that did not finish (or never ran) its error is
        logged, not raised, so the error that stopped the setup is the one the process exits with."""
        try:
            self.stage.close()
        except Exception:
            if self._set_up:
                raise
            self.log.exception("%s: close() raised after a setup that did not finish (the setup's error follows)",
                               self.instance_id)

    def _turn(self) -> None:
        if self._fatal:
            raise HandshakeError(self._fatal)
        if self.state is not self._announced:  # tell the broker at once: it stops delivering here
            self._announced = self.state
            self._send(Heartbeat(self.state.value, self._inbox.qsize()))
        if self.state is RunnerState.RUNNING and not self.paused and self.host.can_produce():
            self.host.produce()
            if self.host.exhausted:
                self._enter(RunnerState.DRAINING, "source exhausted")
            return
        if self.host.in_flight:  # never wait on the inbox: the inputs in flight need advancing
            while not self._inbox.empty():
                self._on_item(self._inbox.get_nowait())
            self.host.advance()
        else:
            with contextlib.suppress(queue.Empty):
                self._on_item(self._inbox.get(timeout=0.05))
        self.host.take_waiting(self.state is RunnerState.RUNNING)
        if self.state is RunnerState.DRAINING and self._drained():
            self._enter(RunnerState.STOPPED, "drained")

    def _on_item(self, item: Deliver | Control | None) -> None:
        if isinstance(item, Deliver):  # waits for room among the inputs in flight, if the stage has several
            self.host.in_flight.waiting.append(item)
            self.host.take_waiting(self.state is RunnerState.RUNNING)
        elif isinstance(item, Control):
            self._on_control(item)

    def _on_control(self, control: Control) -> None:
        if control.op == "weights_ready":
            self.group.share(GroupWeights(control.version))
            self.stage.on_weights(control.version)
        elif control.op in ("pause", "resume"):
            self.paused = control.op == "pause"
        elif control.op in ("drain", "shutdown"):
            self._enter(RunnerState.DRAINING, f"control {control.op}")
            # shutdown: the broker takes over the payloads; wait only for publish confirmations
            self._wait_for_releases = control.op == "drain"

    def _drained(self) -> bool:
        """Every publish confirmed and (unless shutting down) every payload released, or
        drain_timeout_s spent. A source that ran out of items waits for its payloads' releases
        without that limit: its consumers may be far behind (an engine still starting), and
        stopping would take the payloads they have not read yet with it. Inputs in flight are
        advanced to their end, or given back to the broker after drain_timeout_s."""
        if self.host.in_flight and time.monotonic() - self._drain_started <= self.drain_timeout_s:
            return False
        self.host.give_back(f"{self.instance_id} stopped draining after {self.drain_timeout_s}s")
        unconfirmed = self.host.unconfirmed()
        held = self.transport.held() if self._wait_for_releases else 0
        if not unconfirmed and not held:
            return True
        if self.host.exhausted and self._wait_for_releases:
            return False
        if time.monotonic() - self._drain_started <= self.drain_timeout_s:
            return False
        if unconfirmed:
            self.log.warning("%s: stopping with %d publish(es) the broker never confirmed", self.instance_id,
                             unconfirmed)
        return True

    def request_stop(self) -> None:
        """Signal handler: first call drains, second stops now. Only flips state."""
        if self.state is RunnerState.RUNNING:
            self.state = RunnerState.DRAINING
            self._drain_started = time.monotonic()
            self.host.accepting = False
        else:
            self.state = RunnerState.STOPPED
            self.host.abort.set()
            self.host.wake()

    def _enter(self, state: RunnerState, why: str) -> None:
        if self.state is state or self.state is RunnerState.STOPPED:
            return
        self.log.info("%s: %s -> %s (%s)", self.instance_id, self.state.value, state.value, why)
        self.state = state
        if state is RunnerState.DRAINING:
            self._drain_started = time.monotonic()
            self.host.accepting = False

    def _await_handshake(self) -> None:
        if not self._ready.wait(self.handshake_timeout_s):
            raise HandshakeError(
                f"{self.instance_id}: no READY from broker {self.broker_address} within "
                f"{self.handshake_timeout_s}s (is it running? are the CURVE keys right?)"
            )
        if self._fatal:
            raise HandshakeError(f"{self.instance_id}: broker refused the handshake: {self._fatal}")

    def _share_batch(self, handle: Handle) -> None:
        """Every rank of the group fetches `handle` before the leader steps on it (and acks it)."""
        self.group.share(GroupBatch(handle))
        self.group.barrier()

    def _stop_group(self) -> None:
        """Tell the other ranks to stop (once); a group whose ranks are gone is only logged."""
        if self._group_stopped:
            return
        self._group_stopped = True
        try:
            self.group.share(GroupStop(self.state.value))
            self.group.stopped_together = True
        except Exception as exc:  # noqa: BLE001 - a dead rank: the launcher reports it
            self.log.warning("%s: could not tell the other ranks to stop: %s", self.instance_id, exc)

    def _send_control(self, op: ControlOp, version: int = -1) -> None:
        self._send(Control(op, "*", version))

    def _send(self, message: Message) -> None:
        frame = self._encoder.encode(message)
        if threading.current_thread() is self._io_thread:
            self._to_broker(frame)
        else:
            with self._pipe_out_lock:
                self._pipe_out.send(frame)

    def _shutdown(self) -> None:
        self.state = RunnerState.STOPPED
        self.host.take_waiting(running=False)  # not begun: given back
        self.host.give_back(f"{self.instance_id} stopped")  # a stop with inputs in flight
        try:
            self._close_stage()
        finally:
            if self._io_thread.is_alive():
                self._io_stop.set()
                with self._pipe_out_lock:
                    self._pipe_out.send(b"")  # wake the io thread now, not at its next heartbeat
                self._io_thread.join(timeout=5)
            self.transport.close()
            self._pipe_out.close(linger=0)
            self._pipe_in.close(linger=0)
            self._context.term()

    # ---- io thread ---------------------------------------------------------------------------

    def _hello(self) -> None:
        now = time.monotonic()
        if now - self._last_hello < self._heartbeat_interval:
            return  # several "unknown peer" errors in a row need one hello
        self._last_hello = now
        self._send(Hello(SCHEMA_VERSION, self.stage_name, self.instance_id, self.capabilities, os.getpid(), host_id(),
                         os.environ.get(HOST_SERVER_ENV, "")))

    def _io_loop(self) -> None:
        """The io thread: owns the DEALER and closes it on every path, since `Context.term()` in
        `_shutdown` waits for every socket of the context (a send blocked on a broker that never
        answered, e.g. a CURVE broker refusing our keys, is ended by that term and lands here)."""
        self._dealer = sockets.dealer(self._context, self.broker_address, self.instance_id, self.key_dir)
        try:
            self._serve_dealer()
        except zmq.ContextTerminated:
            self.log.warning("%s: the stage stopped while a message to the broker waited to go out", self.instance_id)
        finally:
            self._dealer.close(linger=1000 if self._ready.is_set() else 0)

    def _serve_dealer(self) -> None:
        poller = zmq.Poller()
        poller.register(self._dealer, zmq.POLLIN)
        poller.register(self._pipe_in, zmq.POLLIN)
        self._hello()
        last_heard = time.monotonic()
        next_beat = last_heard + self._heartbeat_interval
        beats = 0
        while not self._io_stop.is_set():
            events = dict(poller.poll(max(1, int((next_beat - time.monotonic()) * 1000))))
            if self._pipe_in in events:
                self._forward_pipe()
            if self._dealer in events:
                last_heard = time.monotonic()
                self._read_dealer()
            now = time.monotonic()
            if now >= next_beat:
                beats += 1
                # "stopped" is said once, last
                state = "draining" if self.state is RunnerState.STOPPED else self.state.value
                self._to_broker(self._encoder.encode(Heartbeat(state, self._inbox.qsize())))
                if beats % 10 == 0:
                    counters = {**self.host.counters, **self.transport.counters}
                    self._to_broker(self._encoder.encode(Stats(self.instance_id, counters)))
                if now - last_heard > 4 * self._heartbeat_interval:
                    if self.state is not RunnerState.RUNNING:
                        # stopping with nobody to drain to (the launcher died and took the broker
                        # along): a step waiting for producer credit would wait forever
                        self.log.warning("%s: broker silent for %.1fs while %s: stopping now", self.instance_id,
                                         now - last_heard, self.state.value)
                        self.request_stop()  # not running: this stops
                    else:
                        self.log.warning("%s: broker silent for %.1fs, saying hello again", self.instance_id,
                                         now - last_heard)
                        self._hello()
                    last_heard = now
                next_beat = now + self._heartbeat_interval
        self._forward_pipe()
        if self._ready.is_set():  # a broker that never said READY has nothing to drop
            self._to_broker(self._encoder.encode(Heartbeat("stopped")))  # the broker drops us now

    def _forward_pipe(self) -> None:
        """Everything the stage thread queued goes out as one multipart message (one frame per
        message): an ack, a credit request and the next publish cost one socket send."""
        frames = []
        while len(frames) < MAX_FRAMES_PER_SEND:
            try:
                frame = self._pipe_in.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            if frame:  # an empty frame only wakes this thread (stop)
                frames.append(frame)
        if frames:
            self._to_broker(*frames)

    def _to_broker(self, *frames: bytes) -> None:
        try:
            self._dealer.send_multipart(frames)
        except zmq.Again:  # no connection for sndtimeo: publishes are resent after the next hello
            self.host.counters["send_failed"] += 1
            self.log.warning("%s: broker unreachable, a message was not sent", self.instance_id)

    def _read_dealer(self) -> None:
        while self._dealer.poll(0):
            for frame in self._dealer.recv_multipart(copy=False):
                try:
                    message = decode(frame.buffer)
                except MessageRejected as exc:
                    self.log.error("%s: unreadable message from broker: %s", self.instance_id, exc)
                    continue
                self._on_broker_message(message)

    def _on_broker_message(self, message: Message) -> None:
        if isinstance(message, (Deliver, Control)):
            if isinstance(message, Control) and message.op == "shutdown":
                self.host.abort.set()  # a step waiting for credit or an engine gives up its input
            self._inbox.put(message)
        elif isinstance(message, Request):
            self.host.on_producer_credit(message)
            self._inbox.put(None)  # a source waiting for credit steps again now
        elif isinstance(message, Ack):
            self.host.on_confirmed(message)
        elif isinstance(message, Release):
            self.host.on_release(message)
        elif isinstance(message, Ready):
            self._heartbeat_interval = message.heartbeat_interval_s
            self.host.on_ready(message)
            self._ready.set()
        elif isinstance(message, Error):
            self._on_error(message)

    def _on_error(self, error: Error) -> None:
        if error.fatal:
            self._fatal = error.reason
            self._ready.set()
            self.host.abort.set()
        elif error.code == "unknown_peer":
            self.log.warning("%s: broker does not know us (restarted?): saying hello again", self.instance_id)
            self._hello()
        else:
            self.log.error("%s: broker rejected a message: %s", self.instance_id, error.reason)
