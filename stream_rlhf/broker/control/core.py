"""The broker's logic: routing, joins, credits, acks, redelivery and liveness, without sockets.

`BrokerCore.handle(peer, message, now)` and `tick(now)` update the state and queue outgoing
messages; `flush()` hands them out as (peer, message) pairs. The process wrapper (`server.py`)
owns the ROUTER socket; in-process tests drive the same core directly (`inprocess.py`).

BrokerCore holds the state (`state.py`: instances, entries, queues) and routes each message to
the module of its concern, plain functions of the core:

    membership.py  hello, leaving, redelivery of what a leaving instance held
    publish.py     publish, duplicates, routing into queues and joins
    dispatch.py    consumer credit, delivery, producer credit
    acks.py        acks, nacks, finished handles, payload release
    stopping.py    the stop: catch-up of the aligned consumers, then shutdown

    Publish ──► entry{pending consumers} ──► queue[(topic, stage)] ──► Deliver to the least
       │                                   └► join partials ─► joined handle     loaded instance
       └─ Ack to producer (journaled)        Ack from every consumer ──► Release to producer

Waits for / unblocked by:
    delivery of queue[(t, s)]   waits for an instance of s with credit on t that is not paused,
                                and for admission (overlap depth); unblocked by Request, Ack,
                                Control(resume / weights_ready)
    producer credit on t        waits for room in every consumer queue of t (less the credit
                                its peers hold, up to their share); unblocked by delivery
                                (queue shrinks), join completion or a peer leaving
    shutdown to the stages      waits for the aligned consumers to catch up (`catch_up.py`);
                                unblocked by their acks, their leaving or `end_catch_up`

Once a stop begins nothing is delivered but what a catch-up needs, and producers get no credit.
"""

from __future__ import annotations

import logging
import uuid
from collections import OrderedDict, defaultdict, deque

from stream_rlhf.broker.control import stopping
from stream_rlhf.broker.control.acks import on_ack, on_nack
from stream_rlhf.broker.control.admission import Admission, AdmitAll
from stream_rlhf.broker.control.catch_up import CatchUp
from stream_rlhf.broker.control.dispatch import dispatch, grant_producer_credit, on_credit
from stream_rlhf.broker.control.journal import Journal
from stream_rlhf.broker.control.membership import on_hello, remove_instance
from stream_rlhf.broker.control.messages import (
    Ack,
    Control,
    Error,
    Handle,
    Heartbeat,
    Hello,
    Message,
    Nack,
    Publish,
    Reclaim,
    Release,
    Request,
    Stats,
)
from stream_rlhf.broker.control.publish import on_publish, route
from stream_rlhf.broker.control.reclaim import unlink_payload
from stream_rlhf.broker.control.state import JOIN, Entry, Instance
from stream_rlhf.broker.control.topology import CONTROL_STAGE, BrokerConfig, Topology
from stream_rlhf.broker.ratelog import RateLimitedLog, truncate

log = logging.getLogger(__name__)

REASON_CHARS = 1000  # an Error's reason is cut to this (the wire allows 4096)


class BrokerCore:
    def __init__(
        self,
        topology: Topology,
        config: BrokerConfig,
        now: float,
        admission: Admission | None = None,
        broker_id: str = "",
    ):
        self.topology = topology
        self.config = config
        self.admission = admission or AdmitAll()
        self.broker_id = broker_id or uuid.uuid4().hex[:8]
        self.host = ""  # set by the server: segments of dead producers on this host are reclaimed
        self.host_servers: dict[str, str] = {}
        """Host id -> its payload server, from the instances' Hellos (`reclaim.py` asks them)."""
        self.reclaims: list[tuple[str, Reclaim]] = []
        """Reclaim requests for other hosts' payload servers, which the server loop sends."""
        self.policy_version = 0  # the initial weights; training step n publishes n + 1
        self.instances: dict[bytes, Instance] = {}
        self.by_instance_id: dict[str, bytes] = {}
        self.entries: dict[str, Entry] = {}
        self.recent: OrderedDict[str, None] = OrderedDict()
        self.queues: dict[tuple[str, str], deque[str]] = {
            (topic, stage): deque() for topic, t in topology.topics.items() for stage in t.consumers
        }
        self.partials: dict[tuple[str, int, int], dict[str, str]] = {}
        self.paused: set[str] = set()
        self.stats: defaultdict[str, float] = defaultdict(float)
        self.ratelog = RateLimitedLog(log)  # every rejection and peer-caused warning goes through it
        self.started = now
        self.stopping = False
        """A stop was asked (the server then calls `begin_stop`)."""
        self.catch_up: CatchUp | None = None
        """Set once the stop began: what the aligned consumers still lack."""
        self.shutdown_sent = False
        self.out: list[tuple[bytes, Message]] = []
        self.acks_to: defaultdict[bytes, list[str]] = defaultdict(list)
        """Publishes to acknowledge, per producer: one Ack each at `flush`."""
        self.releases_to: defaultdict[bytes, list[str]] = defaultdict(list)
        """Handles whose payload the producer may free, per producer: one Release each at `flush`."""
        self.dirty_queues: set[tuple[str, str]] = set()
        """Queues that may deliver now (new handles, credit, resume): dispatched at `flush`."""
        self.dirty_topics: set[str] = set()
        """Topics whose room or producers changed: producer credit granted at `flush`."""
        self.stage_outputs = {stage: set(topology.outputs_of(stage)) for stage in topology.stages()}
        self.credit_chunk = max(1, config.queue_capacity // 4)
        self.journal = Journal(config.journal, config.journal_fsync) if config.journal else None
        if self.journal:
            self._recover(self.journal.live)

    # ---- entry points -------------------------------------------------------------------

    def handle(self, peer: bytes, message: Message, now: float) -> None:
        inst = self.instances.get(peer)
        if isinstance(message, Hello):
            on_hello(self, peer, message, now)
            return
        if inst is None:
            if isinstance(message, Heartbeat) and message.state == "stopped":
                return  # a goodbye from a peer already removed (or never known)
            self.reject(peer, f"{type(message).__name__.lower()} from unknown peer: send hello first", "unknown_peer")
            return
        inst.last_seen = now
        if isinstance(message, Publish):
            on_publish(self, inst, message.handle)
        elif isinstance(message, Request):
            on_credit(self, inst, message)
        elif isinstance(message, Ack):
            for handle_id in message.handle_ids:
                on_ack(self, inst, handle_id)
        elif isinstance(message, Nack):
            on_nack(self, inst, message)
        elif isinstance(message, Heartbeat):
            if message.state == "stopped":
                remove_instance(self, inst, "stopped")
            elif message.state == "draining":
                inst.credits.clear()  # what it nacks back goes to the other instances
        elif isinstance(message, Control):
            self._on_control(inst, message)
        elif isinstance(message, Stats):
            if message.counters:
                inst.counters = dict(message.counters)
            else:
                self.send(peer, Stats(f"broker:{self.broker_id}", self.snapshot()))
        else:
            self.reject(peer, f"unexpected message type {type(message).__name__} from {inst.instance_id}",
                        "unexpected_type")

    def tick(self, now: float) -> None:
        """Heartbeats out, dead peers (silent past heartbeat_timeout_s) removed, held-back log
        lines summed up."""
        self.ratelog.flush()
        for inst in list(self.instances.values()):
            if now - inst.last_seen > self.config.heartbeat_timeout_s:
                remove_instance(self, inst, f"no heartbeat for {now - inst.last_seen:.1f}s")
            else:
                self.send(inst.peer, Heartbeat())

    def flush(self) -> list[tuple[bytes, Message]]:
        """Dispatch what became deliverable, grant producer credit, return the outgoing messages."""
        for key in list(self.dirty_queues):
            dispatch(self, key)
        self.dirty_queues.clear()
        for topic in list(self.dirty_topics):
            grant_producer_credit(self, topic)
        self.dirty_topics.clear()
        for peer, ids in self.acks_to.items():
            self.out.append((peer, Ack(ids)))
        for peer, ids in self.releases_to.items():
            self.out.append((peer, Release(ids)))
        self.acks_to.clear()
        self.releases_to.clear()
        if self.journal:
            self.journal.flush()
        out, self.out = self.out, []
        return out

    def send(self, peer: bytes, message: Message) -> None:
        """Queue `message` for `peer` (handed out by the next `flush`)."""
        self.out.append((peer, message))

    def reject(self, peer: bytes, reason: str, kind: str, fatal: bool = False) -> None:
        """Counted by `kind`, logged once per kind per window, answered with an Error."""
        self.stats[f"rejected.{kind}"] += 1
        self.stats["rejected"] += 1
        self.ratelog.log(logging.WARNING, kind, "rejected message (%s) from %r: %s", kind, peer, reason)
        self.send(peer, Error(truncate(reason, REASON_CHARS), fatal, kind))

    def snapshot(self) -> dict[str, float]:
        counters = dict(self.stats)
        counters["instances"] = len(self.instances)
        counters["inflight_handles"] = len(self.entries)
        counters["policy_version"] = self.policy_version
        for (topic, stage), queue in self.queues.items():
            counters[f"queue.{topic}.{stage}"] = len(queue)
        for inst in self.instances.values():
            for key, value in inst.counters.items():
                counters[f"{inst.instance_id}.{key}"] = value
        return counters

    def has_instance(self, stage: str) -> bool:
        return any(i.stage == stage for i in self.instances.values())

    def close(self) -> int:
        """Clean shutdown: unlink every payload still tracked; returns the handles left unacked."""
        left = len(self.entries)
        if left:
            log.warning("shutting down with %d handle(s) not acknowledged by every consumer", left)
        entries, self.entries = list(self.entries.values()), {}
        for entry in entries:
            unlink_payload(self, entry.handle)
        if self.journal:
            self.journal.live.clear()
            self.journal.flush()
            self.journal.close()
            self.journal.path.unlink(missing_ok=True)
        return left

    # ---- stop (`stopping.py`) ---------------------------------------------------------------

    def begin_stop(self) -> None:
        """The job stops: deliver only what the aligned consumers lack of each other's acks
        (`catch_up.py`), then tell every stage to shut down. Once; later calls do nothing."""
        stopping.begin_stop(self)

    @property
    def catching_up(self) -> bool:
        return self.catch_up is not None and not self.shutdown_sent

    def end_catch_up(self) -> None:
        """Stop waiting for the catch-up (`stop_catch_up_s` passed): shut every stage down now."""
        stopping.end_catch_up(self)

    def broadcast_shutdown(self) -> None:
        """Tell every stage instance to drain and stop (the broker is stopping)."""
        stopping.broadcast_shutdown(self)

    # ---- control ---------------------------------------------------------------------------

    def _on_control(self, inst: Instance, control: Control) -> None:
        if control.op == "stats":
            self.send(inst.peer, Stats(f"broker:{self.broker_id}", self.snapshot()))
            return
        if control.target != "*" and control.target not in self.topology.stages():
            self.reject(inst.peer, f"control {control.op}: unknown target stage {truncate(control.target)!r}",
                        "bad_control")
            return
        if control.op == "weights_ready":
            if control.version < 0:
                self.reject(inst.peer, f"weights_ready version {control.version}: must be >= 0", "bad_control")
                return
            self.policy_version = max(self.policy_version, control.version)
            self.dirty_queues.update(self.queues)
        elif control.op in ("pause", "resume"):
            stages = self.topology.stages() if control.target == "*" else {control.target}
            if control.op == "pause":
                self.paused |= stages
            else:
                self.paused -= stages
                self.dirty_queues.update(k for k in self.queues if k[1] in stages)
        elif control.op == "shutdown" and control.target == "*":
            self.begin_stop()  # the stages hear of it once the aligned consumers caught up
            return
        for other in self.instances.values():
            if other.stage != CONTROL_STAGE and control.target in ("*", other.stage):
                self.send(other.peer, control)

    # ---- recovery ----------------------------------------------------------------------------

    def _recover(self, live: dict[str, tuple[Handle, list[str]]]) -> None:
        """Rebuild queues and join partials from the journal: every pending consumer gets the
        handle again; parts already merged into a live joined handle are not re-joined."""
        merged = {parent for handle, _ in live.values() for parent in handle.parents}
        for handle, pending in live.values():
            self.entries[handle.id] = Entry(handle, set(pending), handle.producer)
        for handle, pending in live.values():
            topic = self.topology.topics.get(handle.topic)
            if topic is None:
                log.error("journal: handle %s has topic %r, not in this topology: dropped", handle.id, handle.topic)
                self.stats["dropped.unknown_topic"] += 1
                del self.entries[handle.id]
                continue
            stages = [p for p in pending if p in topic.consumers]
            joins = [p.removeprefix(JOIN) for p in pending if p.startswith(JOIN) and handle.id not in merged]
            route(self, handle, stages, joins)
        if live:
            self.stats["recovered"] = len(live)
            log.info("journal: recovered %d handle(s) in flight", len(live))
