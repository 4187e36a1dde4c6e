"""Runs one stage instance's logic against broker messages, whatever carries them.

`StageHost` turns a Deliver into a Batch (fetching the payload), calls the stage, puts its outputs
in the payload plane, publishes their handles and acks the input. The stage works on an input in
one `step`, or, if it keeps several inputs in flight (`Stage.inputs_in_flight`), from `begin` to
the `advance` call that returns it ended; an exception there gives every input in flight back.
It keeps the instance's credits, its unconfirmed publishes (resent after a reconnect) and the ids
it already processed (a redelivered handle is acked again, not processed twice). The socket
runner (`runner.py`) and the in-process bus (`inprocess.py`) both drive a StageHost, so a stage
behaves the same in both.

Output handle ids are derived from the input handle id (or, for sources, from the stage, topic,
iteration and minibatch): a handle processed twice after a crash publishes the same ids twice,
and the broker keeps one.

Every publish costs one producer credit, resends too: the broker rejects a publish without
credit. A host that may not block for credit (the in-process bus runs every stage on one thread)
and every resend after a (re)handshake wait in `_deferred` until the broker grants some.

Each step is traced (`telemetry/trace.py`, a no-op unless the process started a trace): the wait
before it ("idle": for a delivery, or for a source, for credit), the payload fetch, the step
itself (named after the stage and its input topic, with iteration, mini-batch, policy version and
samples; an input in flight from its begin to its end, on the track "input <k>" of its position
among those in flight, since they overlap) and the publish of its outputs (payload put and credit
wait).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

from stream_rlhf.broker.control.messages import (
    Ack,
    Deliver,
    Handle,
    Message,
    Nack,
    Publish,
    Ready,
    Release,
    Request,
)
from stream_rlhf.broker.payload.server import PayloadError
from stream_rlhf.broker.payload.transport import PayloadTransport
from stream_rlhf.broker.runtime.in_flight import InFlight, InputsInFlight
from stream_rlhf.stage import Batch, Output, Stage, StepAborted
from stream_rlhf.telemetry import trace

log = logging.getLogger(__name__)

DEDUPE_WINDOW = 65_536
IDLE_MIN_NS = 100_000
"""Waits shorter than this (a delivery already queued) are not traced: they would only add events."""


class StageHost:
    def __init__(
        self,
        stage: Stage,
        stage_name: str,
        instance_id: str,
        transport: PayloadTransport,
        send: Callable[[Message], None],
        prefetch: int = 2,
        wait_for_credit: bool = True,
        before_step: Callable[[Handle], None] | None = None,
        step_context: Callable[[Batch | None], AbstractContextManager[None]] = nullcontext,
    ):
        self.stage = stage
        self.before_step = before_step
        """Called with each fetched handle before the stage steps on it (a rank group's leader
        shares it with the other ranks)."""
        self.step_context = step_context
        """Every step runs inside one, given its batch (None for a source): the launcher's core
        lending marks the instance busy, offload policies move the model (`weights/device_turns.py`)."""
        self.stage_name = stage_name
        self.instance_id = instance_id
        self.transport = transport
        self.send = send
        self.prefetch = prefetch
        self.wait_for_credit = wait_for_credit
        self.inputs: list[str] = []
        self.outputs: list[str] = []
        self.exhausted = False
        self.accepting = True  # False while draining: no new consumer credit is asked for
        self.abort = threading.Event()  # the stage's StageContext.stopping
        self._credit = threading.Condition()
        self._producer_credit: dict[str, int] = {}
        self._unconfirmed: dict[str, Publish] = {}
        self._deferred: deque[Publish] = deque()  # published once the broker grants credit
        self._epoch = 0  # handshakes so far: credit taken before the last one is void
        self._processed: OrderedDict[str, None] = OrderedDict()
        self._idle_since_ns: int | None = None  # the end of the last step (or of setup): traced waits
        self.in_flight = InputsInFlight()
        self.counters: dict[str, float] = {
            "steps": 0, "step_s": 0.0, "fetch_s": 0.0, "put_s": 0.0, "published": 0,
            "duplicates_skipped": 0, "credit_wait_s": 0.0, "nacked": 0, "send_failed": 0, "await_s": 0.0,
        }

    # ---- called on the IO side --------------------------------------------------------------

    def on_ready(self, ready: Ready) -> None:
        """After every (re)handshake: fresh credit; what the broker never confirmed is resent as
        credit comes (a restarted broker has not seen it; the same one acks a duplicate)."""
        self.inputs, self.outputs = list(ready.inputs), list(ready.outputs)
        with self._credit:
            self._producer_credit = {topic: 0 for topic in self.outputs}
            self._deferred = deque(self._unconfirmed.values())
            self._epoch += 1
        if self.accepting:
            for topic in self.inputs:
                self.send(Request(topic, self.prefetch))

    def on_producer_credit(self, request: Request) -> None:
        """Credit pays for deferred publishes first (in order), the rest is the stage's."""
        with self._credit:
            self._producer_credit[request.topic] = self._producer_credit.get(request.topic, 0) + request.credits
            ready, waiting = [], deque()
            for publish in self._deferred:
                topic = publish.handle.topic
                if publish.handle.id not in self._unconfirmed:
                    continue  # confirmed or released meanwhile
                if self._producer_credit.get(topic, 0) > 0:
                    self._producer_credit[topic] -= 1
                    ready.append(publish)
                else:
                    waiting.append(publish)
            self._deferred = waiting
            self._credit.notify_all()
        for publish in ready:
            self.send(publish)

    def on_release(self, release: Release) -> None:
        """Every consumer acked these handles, or the broker rejected their publish: free them."""
        with self._credit:
            for handle_id in release.handle_ids:
                self._unconfirmed.pop(handle_id, None)
        for handle_id in release.handle_ids:
            self.transport.release(handle_id)

    def on_confirmed(self, ack: Ack) -> None:
        with self._credit:
            for handle_id in ack.handle_ids:
                self._unconfirmed.pop(handle_id, None)
            self._credit.notify_all()

    def unconfirmed(self) -> int:
        with self._credit:
            return len(self._unconfirmed)

    def wake(self) -> None:
        with self._credit:
            self._credit.notify_all()

    # ---- called on the stage's thread -------------------------------------------------------

    def process(self, deliver: Deliver) -> None:
        """One `step` on a delivered input, then its outputs published and the input acked."""
        taken = self._take(deliver)
        if taken is None:
            return
        batch, fetched = taken
        handle = batch.handle
        try:
            with self.step_context(batch):
                outputs = self.stage.step(batch) or []
        except Exception as exc:
            self.send(Nack(handle.id, f"{type(exc).__name__} in {self.stage_name}.step: {exc}", requeue=True))
            raise
        self._count_step(fetched, f"{self.stage_name} {handle.topic}", handle.topic, handle.iteration,
                         handle.minibatch, handle.policy_version, handle.num_samples)
        self._finish(handle, outputs)
        self._idle_since_ns = trace.now_ns()

    def _take(self, deliver: Deliver) -> tuple[Batch, int] | None:
        """A delivered input fetched and awaited (`Stage.await_inputs`): its batch and when work on it
        may start, or None for a duplicate or a payload that is gone (both answered here)."""
        handle = deliver.handle
        if handle.id in self._processed:
            self.counters["duplicates_skipped"] += 1
            self.send(Ack([handle.id]))
            self._replenish(handle.topic)
            return None
        started = trace.now_ns()
        self._trace_idle(started, "delivery")
        try:
            tensors = self.transport.get(handle)
        except PayloadError as exc:
            self.counters["nacked"] += 1
            self.send(Nack(handle.id, f"payload unavailable: {exc}", requeue=False))
            self._replenish(handle.topic)
            return None
        if self.before_step is not None:
            self.before_step(handle)
        fetched = trace.now_ns()
        self.counters["fetch_s"] += (fetched - started) / 1e9
        trace.complete("fetch", "payload", started, fetched, topic=handle.topic, producer=handle.producer)
        batch = Batch(handle, tensors)
        try:
            self.stage.await_inputs(batch)
        except Exception as exc:
            self.send(Nack(handle.id, f"{type(exc).__name__} in {self.stage_name}.await_inputs: {exc}",
                           requeue=True))
            raise
        awaited = trace.now_ns()
        if awaited - fetched >= IDLE_MIN_NS:  # not part of the step: a wait for another stage
            self.counters["await_s"] += (awaited - fetched) / 1e9
            trace.complete("idle", "wait", fetched, awaited, waiting_for="inputs")
        return batch, awaited

    def _finish(self, handle: Handle, outputs: list[Output]) -> None:
        """Publish what the work on input `handle` gave, remember it as processed, ack it."""
        self._publish_all(outputs, handle, lambda topic, k: f"{handle.id}/{topic}/{k}")
        self._processed[handle.id] = None
        if len(self._processed) > DEDUPE_WINDOW:
            self._processed.popitem(last=False)
        self.send(Ack([handle.id]))
        self._replenish(handle.topic)

    # ---- a stage with several inputs in flight (Stage.inputs_in_flight() > 1) ----------------

    def allow_in_flight(self, inputs: int) -> None:
        """After setup: the stage works on `inputs` delivered inputs at once, so at least that many
        deliveries may be outstanding (the prefetch is raised to it, the difference asked now)."""
        self.in_flight.limit = inputs
        extra = inputs - self.prefetch
        if extra > 0:
            self.prefetch = inputs  # what later handshakes ask
            if self.accepting:
                for topic in self.inputs:
                    self.send(Request(topic, extra))

    def take_waiting(self, running: bool) -> None:
        """Deliveries in `in_flight.waiting` are taken in order while there is room (processed, or
        begun by a stage with several inputs in flight); when not running they go back to the broker."""
        waiting = self.in_flight.waiting
        while waiting and (not running or self.in_flight.has_room()):
            deliver = waiting.popleft()
            if not running:
                self.send(Nack(deliver.handle.id, f"{self.instance_id} is draining", requeue=True))
            elif self.in_flight.limit > 1:
                self.begin(deliver)
            else:
                self.process(deliver)

    def begin(self, deliver: Deliver) -> None:
        """Start work on a delivered input (`Stage.begin`); it stays in flight until `advance` sees it end.
        On an exception every input in flight goes back to the broker (Nack, requeue)."""
        try:
            taken = self._take(deliver)
            if taken is None:
                return
            batch, begun = taken
            self.in_flight.add(batch, begun)
            self._idle_since_ns = None  # busy until the last input in flight ends
            with self.step_context(batch):
                self.stage.begin(batch)
        except Exception as exc:
            self.give_back(f"{type(exc).__name__} in {self.stage_name}.begin: {exc}")
            raise

    def advance(self) -> None:
        """One `Stage.advance` (inside the step context of the oldest input in flight); each input that
        ended has its outputs published and is acked, and its step traced from begin to end on the
        track of its in-flight position. On an exception every input in flight goes back (Nack, requeue)."""
        started = time.perf_counter()
        try:
            with self.step_context(self.in_flight.oldest().batch):
                ended = self.stage.advance()
            self.counters["step_s"] += time.perf_counter() - started
            for batch, outputs in ended:
                entry = self.in_flight.begun.get(batch.handle.id)
                if entry is None:
                    raise RuntimeError(f"{self.stage_name}.advance returned the input {batch.handle.id} (iteration "
                                       f"{batch.iteration}, mini-batch {batch.minibatch}), which is not in flight")
                self._end(entry, outputs)
        except Exception as exc:
            self.give_back(f"{type(exc).__name__} in {self.stage_name}.advance: {exc}")
            raise
        if not self.in_flight:
            self._idle_since_ns = trace.now_ns()

    def _end(self, entry: InFlight, outputs: list[Output]) -> None:
        handle = entry.batch.handle
        self.counters["steps"] += 1
        trace.complete_on(f"input {entry.slot}", f"{self.stage_name} {handle.topic}", "step", entry.begun_ns,
                          trace.now_ns(), stage=self.stage_name, topic=handle.topic, iteration=handle.iteration,
                          minibatch=handle.minibatch, policy_version=handle.policy_version,
                          samples=handle.num_samples)
        self._finish(handle, outputs)
        del self.in_flight.begun[handle.id]

    def give_back(self, reason: str) -> None:
        """Every input in flight goes back to the broker (Nack, requeue) and is forgotten here."""
        if self.in_flight:
            log.warning("%s: %d input(s) in flight given back to the broker: %s", self.instance_id,
                        len(self.in_flight), reason)
        for handle_id in self.in_flight.begun:
            self.send(Nack(handle_id, reason, requeue=True))
        self.in_flight.begun.clear()

    def can_produce(self) -> bool:
        """A source may step when it is not exhausted and every output topic has credit."""
        if self.inputs or self.exhausted or not self.accepting or not self.outputs:
            return False
        with self._credit:
            return all(self._producer_credit.get(t, 0) > 0 for t in self.outputs)

    def produce(self) -> None:
        started = trace.now_ns()
        self._trace_idle(started, "credit")
        with self.step_context(None):
            outputs = self.stage.step(None)
        if outputs is None:
            self.exhausted = True
            log.info("%s: source exhausted", self.instance_id)
            return
        first = outputs[0] if outputs else None
        self._count_step(started, self.stage_name, "", first.iteration if first else -1,
                         first.minibatch if first else -1, first.policy_version if first else -1,
                         sum(o.num_samples for o in outputs))
        self._publish_all(
            outputs, None, lambda topic, k: f"{self.stage_name}/{topic}/{outputs_key(outputs, topic, k)}"
        )
        self._idle_since_ns = trace.now_ns()

    def mark_idle(self) -> None:
        """From now on the instance waits for work (the runner calls it once the stage is set up)."""
        self._idle_since_ns = trace.now_ns()

    def _trace_idle(self, now_ns: int, waiting_for: str) -> None:
        if self._idle_since_ns is not None and now_ns - self._idle_since_ns >= IDLE_MIN_NS:
            trace.complete("idle", "wait", self._idle_since_ns, now_ns, waiting_for=waiting_for)

    def _count_step(self, started_ns: int, name: str, topic: str, iteration: int | None, minibatch: int | None,
                    policy_version: int | None, samples: int) -> None:
        """Count (and trace) a step that began at `started_ns` and ends now."""
        ended = trace.now_ns()
        self.counters["steps"] += 1
        self.counters["step_s"] += (ended - started_ns) / 1e9
        trace.complete(name, "step", started_ns, ended, stage=self.stage_name, topic=topic, iteration=iteration,
                       minibatch=minibatch, policy_version=policy_version, samples=samples)

    def _replenish(self, topic: str) -> None:
        if self.accepting:
            self.send(Request(topic, 1))

    def _publish_all(self, outputs: list[Output], parent: Handle | None, key: Callable[[str, int], str]) -> None:
        if outputs:
            with trace.span("publish", "payload", topics=sorted({o.topic for o in outputs})):
                self._publish_each(outputs, parent, key)

    def _publish_each(self, outputs: list[Output], parent: Handle | None, key: Callable[[str, int], str]) -> None:
        per_topic: dict[str, int] = {}
        for out in outputs:
            if out.topic not in self.outputs:
                raise ValueError(
                    f"{self.stage_name}.step returned topic {out.topic!r}; this stage publishes {self.outputs}"
                )
            k = per_topic.get(out.topic, 0)
            per_topic[out.topic] = k + 1
            handle_id = str(uuid.uuid5(uuid.NAMESPACE_OID, key(out.topic, k)))
            epoch = self._wait_credit(out.topic) if self.wait_for_credit else self._epoch
            started = time.perf_counter()
            fields = self.transport.put(handle_id, out.tensors)
            self.counters["put_s"] += time.perf_counter() - started
            handle = Handle(
                id=handle_id,
                topic=out.topic,
                iteration=_inherit(out.iteration, parent, "iteration", out.topic),
                minibatch=_inherit(out.minibatch, parent, "minibatch", out.topic),
                policy_version=out.policy_version if out.policy_version is not None
                else (parent.policy_version if parent else -1),
                num_samples=out.num_samples,
                fields=fields,
                metadata=out.metadata,
                producer=self.instance_id,
            )
            publish = Publish(handle)
            with self._credit:
                self._unconfirmed[handle_id] = publish
                send_now = self._spend(out.topic, epoch)
                if not send_now:
                    self._deferred.append(publish)
            if send_now:
                self.send(publish)
            self.counters["published"] += 1

    def _wait_credit(self, topic: str) -> int:
        """Block until the broker grants credit on `topic`, take one; returns the handshake epoch."""
        started = time.perf_counter()
        with self._credit:
            while self._producer_credit.get(topic, 0) <= 0:
                if self.abort.is_set():
                    raise StepAborted(f"{self.instance_id}: stopped while waiting for credit on {topic}")
                self._credit.wait(0.1)
            self._producer_credit[topic] -= 1
            epoch = self._epoch
        self.counters["credit_wait_s"] += time.perf_counter() - started
        return epoch

    def _spend(self, topic: str, epoch: int) -> bool:
        """Whether a publish on `topic` may go out now (call with the lock held). A blocking host
        took its credit in `_wait_credit`, unless a handshake since reset it (then it waits for
        the new broker's credit); a host that does not block takes credit only if there is some."""
        if self.wait_for_credit:
            return epoch == self._epoch
        if self._producer_credit.get(topic, 0) <= 0:
            return False
        self._producer_credit[topic] -= 1
        return True


def outputs_key(outputs: list[Output], topic: str, k: int) -> str:
    out = [o for o in outputs if o.topic == topic][k]
    return f"{out.iteration}/{out.minibatch}/{k}"


def _inherit(value: int | None, parent: Handle | None, name: str, topic: str) -> int:
    if value is not None:
        return value
    if parent is None:
        raise ValueError(f"output on {topic!r} from a source stage must set {name}")
    return getattr(parent, name)
