"""The broker's logic: routing, joins, credits, acks, redelivery and liveness, without sockets.

`BrokerCore.handle(peer, message, now)` and `tick(now)` update the state and queue outgoing
messages; `flush()` hands them out as (peer, message) pairs. The process wrapper (`server.py`)
owns the ROUTER socket; in-process tests drive the same core directly (`inprocess.py`).

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
from dataclasses import dataclass, field

import msgspec

from stream_rlhf.broker.payload import shm
from stream_rlhf.broker.control.admission import Admission, AdmitAll
from stream_rlhf.broker.control.catch_up import CatchUp
from stream_rlhf.broker.control.join import merge_parts
from stream_rlhf.broker.control.journal import Journal
from stream_rlhf.broker.control.messages import (
    SCHEMA_VERSION,
    Ack,
    Control,
    Deliver,
    Error,
    Handle,
    Heartbeat,
    Hello,
    Message,
    Nack,
    Publish,
    Ready,
    Release,
    Request,
    Stats,
)
from stream_rlhf.broker.ratelog import RateLimitedLog, truncate
from stream_rlhf.broker.control.topology import CONTROL_STAGE, BrokerConfig, Topology

log = logging.getLogger(__name__)

RECENT_IDS = 200_000  # finished handle ids remembered to deduplicate late re-publishes
JOIN = "join:"  # pending-consumer names of joins, apart from stage names (which have no ":")
REASON_CHARS = 1000  # an Error's reason is cut to this (the wire allows 4096)


@dataclass
class Instance:
    peer: bytes
    stage: str
    instance_id: str
    pid: int
    host: str
    last_seen: float
    credits: dict[str, int] = field(default_factory=dict)  # consumer credit per input topic
    granted: dict[str, int] = field(default_factory=dict)  # producer credit not yet used
    inflight: dict[str, str] = field(default_factory=dict)  # handle id -> topic
    counters: dict[str, float] = field(default_factory=dict)  # last Stats it sent


@dataclass
class Entry:
    handle: Handle
    pending: set[str]  # consumer stages and JOIN + join topic that still owe an ack
    producer: str  # instance id
    attempts: dict[str, int] = field(default_factory=dict)


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
        self._out: list[tuple[bytes, Message]] = []
        self._acks_to: defaultdict[bytes, list[str]] = defaultdict(list)
        self._releases_to: defaultdict[bytes, list[str]] = defaultdict(list)
        self._dirty_queues: set[tuple[str, str]] = set()
        self._dirty_topics: set[str] = set()
        self._outputs = {stage: set(topology.outputs_of(stage)) for stage in topology.stages()}
        self._credit_chunk = max(1, config.queue_capacity // 4)
        self.journal = Journal(config.journal, config.journal_fsync) if config.journal else None
        if self.journal:
            self._recover(self.journal.live)

    # ---- entry points -------------------------------------------------------------------

    def handle(self, peer: bytes, message: Message, now: float) -> None:
        inst = self.instances.get(peer)
        if isinstance(message, Hello):
            self._on_hello(peer, message, now)
            return
        if inst is None:
            if isinstance(message, Heartbeat) and message.state == "stopped":
                return  # a goodbye from a peer already removed (or never known)
            self.reject(peer, f"{type(message).__name__.lower()} from unknown peer: send hello first", "unknown_peer")
            return
        inst.last_seen = now
        if isinstance(message, Publish):
            self._on_publish(inst, message.handle)
        elif isinstance(message, Request):
            self._on_credit(inst, message)
        elif isinstance(message, Ack):
            for handle_id in message.handle_ids:
                self._on_ack(inst, handle_id)
        elif isinstance(message, Nack):
            self._on_nack(inst, message)
        elif isinstance(message, Heartbeat):
            if message.state == "stopped":
                self._remove_instance(inst, "stopped")
            elif message.state == "draining":
                inst.credits.clear()  # what it nacks back goes to the other instances
        elif isinstance(message, Control):
            self._on_control(inst, message)
        elif isinstance(message, Stats):
            if message.counters:
                inst.counters = dict(message.counters)
            else:
                self._send(peer, Stats(f"broker:{self.broker_id}", self.snapshot()))
        else:
            self.reject(peer, f"unexpected message type {type(message).__name__} from {inst.instance_id}", "unexpected_type")

    def tick(self, now: float) -> None:
        """Heartbeats out, dead peers (silent past heartbeat_timeout_s) removed, held-back log
        lines summed up."""
        self.ratelog.flush()
        for inst in list(self.instances.values()):
            if now - inst.last_seen > self.config.heartbeat_timeout_s:
                self._remove_instance(inst, f"no heartbeat for {now - inst.last_seen:.1f}s")
            else:
                self._send(inst.peer, Heartbeat())

    def flush(self) -> list[tuple[bytes, Message]]:
        """Dispatch what became deliverable, grant producer credit, return the outgoing messages."""
        for key in list(self._dirty_queues):
            self._dispatch(key)
        self._dirty_queues.clear()
        for topic in list(self._dirty_topics):
            self._grant_producer_credit(topic)
        self._dirty_topics.clear()
        for peer, ids in self._acks_to.items():
            self._out.append((peer, Ack(ids)))
        for peer, ids in self._releases_to.items():
            self._out.append((peer, Release(ids)))
        self._acks_to.clear()
        self._releases_to.clear()
        if self.journal:
            self.journal.flush()
        out, self._out = self._out, []
        return out

    def reject(self, peer: bytes, reason: str, kind: str, fatal: bool = False) -> None:
        """Counted by `kind`, logged once per kind per window, answered with an Error."""
        self.stats[f"rejected.{kind}"] += 1
        self.stats["rejected"] += 1
        self.ratelog.log(logging.WARNING, kind, "rejected message (%s) from %r: %s", kind, peer, reason)
        self._send(peer, Error(truncate(reason, REASON_CHARS), fatal, kind))

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

    def close(self) -> int:
        """Clean shutdown: unlink every payload still tracked; returns the handles left unacked."""
        left = len(self.entries)
        if left:
            log.warning("shutting down with %d handle(s) not acknowledged by every consumer", left)
        entries, self.entries = list(self.entries.values()), {}
        for entry in entries:
            self._unlink_payload(entry.handle)
        if self.journal:
            self.journal.live.clear()
            self.journal.flush()
            self.journal.close()
            self.journal.path.unlink(missing_ok=True)
        return left

    # ---- handshake and membership ---------------------------------------------------------

    def _on_hello(self, peer: bytes, hello: Hello, now: float) -> None:
        if hello.schema_version != SCHEMA_VERSION:
            self.reject(
                peer, f"schema version {hello.schema_version} != broker's {SCHEMA_VERSION}", "schema", fatal=True
            )
            return
        if hello.stage != CONTROL_STAGE and hello.stage not in self.topology.stages():
            known = ", ".join(sorted(self.topology.stages()))
            self.reject(peer, f"stage {truncate(hello.stage)!r} is not in the topology (stages: {known})", "unknown_stage", fatal=True)
            return
        old = self.instances.get(peer) or self.instances.get(self.by_instance_id.get(hello.instance_id, b""))
        if old is not None:
            self._remove_instance(old, "reconnected")
        inst = Instance(peer, hello.stage, hello.instance_id, hello.pid, hello.host, now)
        self.instances[peer] = inst
        self.by_instance_id[hello.instance_id] = peer
        inputs, outputs = self.topology.inputs_of(hello.stage), self.topology.outputs_of(hello.stage)
        self._send(
            peer,
            Ready(SCHEMA_VERSION, self.broker_id, self.config.heartbeat_interval_s, self.config.max_message_bytes, inputs, outputs),
        )
        if self.policy_version > 0:
            self._send(peer, Control("weights_ready", hello.stage, self.policy_version))
        self._dirty_topics.update(outputs)
        log.log(_membership_level(hello.stage), "instance %s of stage %s joined (pid %d)", truncate(hello.instance_id),
                hello.stage, hello.pid)

    def _remove_instance(self, inst: Instance, reason: str) -> None:
        self.instances.pop(inst.peer, None)
        if self.by_instance_id.get(inst.instance_id) == inst.peer:
            del self.by_instance_id[inst.instance_id]
        for handle_id, topic in reversed(list(inst.inflight.items())):
            key = (topic, inst.stage)
            self.queues[key].appendleft(handle_id)
            self._dirty_queues.add(key)
            self.stats["redelivered"] += 1
        if inst.inflight:
            log.warning(
                "instance %s (%s) left: %s; %d handle(s) in flight requeued",
                truncate(inst.instance_id), inst.stage, reason, len(inst.inflight),
            )
        else:
            log.log(_membership_level(inst.stage), "instance %s (%s) left: %s", truncate(inst.instance_id), inst.stage,
                    reason)
        self._dirty_topics.update(inst.granted)
        if self.catching_up:
            if not self._has_instance(inst.stage):
                self.catch_up.give_up(inst.stage)
            self._shut_down_once_caught_up()
        if reason != "stopped" and inst.host == self.host and inst.pid and not shm.pid_alive(inst.pid):
            self._reclaim_unpublished(inst.pid)

    def _reclaim_unpublished(self, pid: int) -> None:
        """A dead producer may have created segments it never published: unlink them."""
        published = {
            spec.location.segment for e in self.entries.values() for spec in e.handle.fields.values()
        }
        for name, owner in shm.list_segments(self.config.shm_prefix):
            if owner == pid and name not in published and shm.unlink(name):
                self.stats["segments_reclaimed"] += 1

    # ---- publish, join, deliver -------------------------------------------------------------

    def _on_publish(self, inst: Instance, handle: Handle) -> None:
        """Every publish costs the producer one credit, a duplicate too (the producer spent one
        on it). Without credit a new handle is rejected and its payload released: the producer
        frees it, nothing is queued."""
        topic = self.topology.topics.get(handle.topic)
        if topic is None or inst.stage not in topic.producers:
            allowed = self.topology.outputs_of(inst.stage)
            self.reject(
                inst.peer, f"publish of handle {truncate(handle.id)} on topic {truncate(handle.topic)!r}: stage "
                f"{inst.stage} publishes only {allowed}", "bad_topic",
            )
            return
        existing = self.entries.get(handle.id)
        duplicate = existing is not None or handle.id in self.recent
        if inst.granted.get(handle.topic, 0) > 0:
            inst.granted[handle.topic] -= 1
        elif not duplicate:
            self._releases_to[inst.peer].append(handle.id)
            self.reject(
                inst.peer, f"publish of handle {truncate(handle.id)} on topic {handle.topic!r} without producer "
                "credit: not queued, its payload released", "no_credit",
            )
            return
        self._acks_to[inst.peer].append(handle.id)
        if duplicate:
            self.stats["duplicate_publishes"] += 1
            if existing is None or existing.producer != inst.instance_id:
                self._releases_to[inst.peer].append(handle.id)  # its copy of the payload is not needed
            return
        if handle.producer != inst.instance_id:
            handle = msgspec.structs.replace(handle, producer=inst.instance_id)
        self._admit(handle, inst.instance_id)

    def _admit(self, handle: Handle, producer: str) -> None:
        topic = self.topology.topics[handle.topic]
        pending = [*topic.consumers, *(JOIN + j for j in self.topology.joins_of(handle.topic))]
        self.entries[handle.id] = Entry(handle, set(pending), producer)
        if self.journal:
            self.journal.published(handle, pending)
        self.stats["published"] += 1
        self.stats[f"published.{handle.topic}"] += 1
        self._route(handle, topic.consumers, self.topology.joins_of(handle.topic))

    def _route(self, handle: Handle, stages: list[str], joins: list[str]) -> None:
        self.admission.published(handle)
        for stage in stages:
            key = (handle.topic, stage)
            self.queues[key].append(handle.id)
            self.stats["max_queue_depth"] = max(self.stats["max_queue_depth"], len(self.queues[key]))
            self._dirty_queues.add(key)
        for join in joins:
            self._add_part(join, handle)
        self._dirty_topics.add(handle.topic)

    def _add_part(self, join: str, part: Handle) -> None:
        key = (join, part.iteration, part.minibatch)
        parts = self.partials.setdefault(key, {})
        if part.topic in parts:
            self.stats["join_duplicate_parts"] += 1
            self.ratelog.log(logging.WARNING, "join_duplicate_part", "join %s: second %s part for %s; the later one "
                             "waits for the next", join, part.topic, key[1:])
        parts[part.topic] = part.id
        order = self.topology.topics[join].join
        if all(p in parts for p in order):
            del self.partials[key]
            self._dirty_topics.update(order)  # parts no longer wait here: producers may get credit
            self._emit_join(join, [self.entries[parts[p]].handle for p in order])

    def _emit_join(self, join: str, parts: list[Handle]) -> None:
        joined, collisions = merge_parts(join, parts)
        self.stats["join_field_collisions"] += collisions
        if len({p.num_samples for p in parts}) > 1:
            self.stats["join_sample_mismatch"] += 1
            self.ratelog.log(logging.WARNING, "join_sample_mismatch", "join %s: parts disagree on num_samples: %s",
                             join, str({p.topic: p.num_samples for p in parts}))
        self.stats["joins_emitted"] += 1
        self._admit(joined, "broker")

    def _dispatch(self, key: tuple[str, str]) -> None:
        topic, stage = key
        queue = self.queues[key]
        if stage in self.paused:
            return
        if self.catch_up is not None:
            self._dispatch_catch_up(key)
            return
        while queue:
            entry = self.entries.get(queue[0])
            if entry is None or stage not in entry.pending:  # acked meanwhile (late ack)
                queue.popleft()
                continue
            if not self.admission.admit(entry.handle, stage, self.policy_version):
                return
            inst = self._least_loaded(stage, topic)
            if inst is None:
                return
            queue.popleft()
            self._deliver(inst, entry, key)

    def _dispatch_catch_up(self, key: tuple[str, str]) -> None:
        """While stopping: only the handles `key`'s stage lacks of what an aligned sibling acked
        (wherever they are in the queue; admission let the sibling have them)."""
        if not self.catching_up:
            return
        topic, stage = key
        queue = self.queues[key]
        for handle_id in [h for h in queue if self.catch_up.wants(stage, h) and h in self.entries]:
            inst = self._least_loaded(stage, topic)
            if inst is None:
                return
            queue.remove(handle_id)
            self._deliver(inst, self.entries[handle_id], key)

    def _least_loaded(self, stage: str, topic: str) -> Instance | None:
        """The instance of `stage` with credit on `topic` and the fewest handles in flight, if any."""
        candidates = [i for i in self.instances.values() if i.stage == stage and i.credits.get(topic, 0) > 0]
        return min(candidates, key=lambda i: len(i.inflight)) if candidates else None

    def _has_instance(self, stage: str) -> bool:
        return any(i.stage == stage for i in self.instances.values())

    def _deliver(self, inst: Instance, entry: Entry, key: tuple[str, str]) -> None:
        topic, stage = key
        inst.credits[topic] -= 1
        inst.inflight[entry.handle.id] = topic
        attempt = entry.attempts.get(stage, 0) + 1
        entry.attempts[stage] = attempt
        self._send(inst.peer, Deliver(entry.handle, attempt))
        self.stats["delivered"] += 1
        self._dirty_topics.add(topic)

    def _grant_producer_credit(self, topic: str) -> None:
        """Share the free room of `topic` among its producers, each up to capacity // producers.

        Credit a producer holds beyond that share (taken while it had fewer peers: the first
        rollout instance to say hello gets the whole capacity) does not count against the others,
        and a producer out of credit gets what is free even below a chunk: it may be waiting, and
        its peers' credit may never be used. Two rollout instances deadlocked so: the late one
        waited for credit holding mini-batch 1 of an iteration, which therefore never trained, so
        no later prompts were admitted and the early one never published what would have freed
        room. The topic may hold that surplus beyond its capacity until it is used."""
        if topic not in self.topology.topics or self.topology.topics[topic].join or self.catch_up is not None:
            return
        producers = [i for i in self.instances.values() if topic in self._outputs.get(i.stage, ())]
        if not producers:
            return
        config = self.topology.topics[topic]
        capacity = config.capacity or self.config.queue_capacity
        share = max(1, capacity // len(producers))
        backlog = max([len(self.queues[(topic, s)]) for s in config.consumers] + [0])
        waiting = 0 if config.capacity else sum(1 for parts in self.partials.values() if topic in parts)
        held = [i.granted.get(topic, 0) for i in producers]
        free = capacity - max(backlog, waiting) - sum(min(h, share) for h in held)
        if all(held) and free < min(self._credit_chunk, capacity):
            return  # every producer still holds credit: grant in chunks, not one message per handle
        grants: dict[bytes, int] = {}
        while free > 0:
            inst = min(producers, key=lambda i: i.granted.get(topic, 0))
            if inst.granted.get(topic, 0) >= share:
                break
            inst.granted[topic] = inst.granted.get(topic, 0) + 1
            grants[inst.peer] = grants.get(inst.peer, 0) + 1
            free -= 1
        for peer, credits in grants.items():
            self._send(peer, Request(topic, credits))

    # ---- consumer side ---------------------------------------------------------------------

    def _on_credit(self, inst: Instance, request: Request) -> None:
        if request.topic not in self.topology.topics or inst.stage not in self.topology.topics[request.topic].consumers:
            self.reject(inst.peer, f"credit for topic {truncate(request.topic)!r}: stage {inst.stage} does not consume it", "bad_topic")
            return
        if request.credits < 0:
            self.reject(inst.peer, f"credit {request.credits} for {request.topic}: must be >= 0", "bad_credit")
            return
        inst.credits[request.topic] = inst.credits.get(request.topic, 0) + request.credits
        self._dirty_queues.add((request.topic, inst.stage))

    def _on_ack(self, inst: Instance, handle_id: str) -> None:
        if inst.inflight.pop(handle_id, None) is None:
            self.stats["stale_acks"] += 1
            return
        self.stats["acked"] += 1
        self._consumer_done(handle_id, inst.stage)

    def _on_nack(self, inst: Instance, nack: Nack) -> None:
        topic = inst.inflight.pop(nack.handle_id, None)
        if topic is None:
            self.stats["stale_acks"] += 1
            return
        self.stats["nacked"] += 1
        entry = self.entries[nack.handle_id]
        if nack.requeue and entry.attempts.get(inst.stage, 0) < self.config.max_attempts:
            self.ratelog.log(logging.WARNING, "nack_requeued", "%s nacked %s (%s): requeued", inst.instance_id,
                             nack.handle_id, nack.reason)
            self.queues[(topic, inst.stage)].appendleft(nack.handle_id)
            self._dirty_queues.add((topic, inst.stage))
            self._shut_down_once_caught_up()
            return
        why = "poison" if nack.requeue else "rejected"
        self.stats[f"dropped.{why}"] += 1
        self.stats["dropped"] += 1
        self.ratelog.log(
            logging.ERROR, f"dropped.{why}", "handle %s (topic %s) dropped for stage %s after %d attempt(s): %s",
            nack.handle_id, topic, inst.stage, entry.attempts.get(inst.stage, 0), nack.reason,
        )
        self._consumer_done(nack.handle_id, inst.stage)

    def _consumer_done(self, handle_id: str, consumer: str) -> None:
        entry = self.entries.get(handle_id)
        if entry is None or consumer not in entry.pending:
            return
        entry.pending.discard(consumer)
        if self.journal:
            self.journal.acked(handle_id, consumer)
        if self.catch_up is not None and not self.shutdown_sent:
            self.catch_up.got(consumer, handle_id)
            self.catch_up.note(entry.handle, entry.pending)  # the siblings that lack it now get it
            self._dirty_queues.update(k for k in self.queues if k[0] == entry.handle.topic)
            self._shut_down_once_caught_up()
        if not entry.pending:
            self._finish(entry)

    def _finish(self, entry: Entry) -> None:
        handle = entry.handle
        del self.entries[handle.id]
        self.recent[handle.id] = None
        if len(self.recent) > RECENT_IDS:
            self.recent.popitem(last=False)
        self.stats["completed"] += 1
        for parent in handle.parents:
            self._consumer_done(parent, JOIN + handle.topic)
        if entry.producer == "broker":
            return
        peer = self.by_instance_id.get(entry.producer)
        if peer is not None:
            self._releases_to[peer].append(handle.id)
        else:
            self._unlink_payload(handle)

    def _unlink_payload(self, handle: Handle) -> None:
        """Free a payload whose producer is gone (crashed, or stopped before every ack). Small
        payloads share a segment, so one is unlinked only when no live handle points into it.
        Only this job's segments (named with its shm_prefix): a handle naming another job's
        segment does not make the broker unlink it."""
        if handle.producer == "broker":
            return
        segments = {
            s.location.segment for s in handle.fields.values()
            if s.location.kind == "shm" and s.location.host == self.host
            and shm.has_prefix(s.location.segment, self.config.shm_prefix)
        }
        if not segments:
            return
        still_used = {spec.location.segment for e in self.entries.values() for spec in e.handle.fields.values()}
        for segment in segments - still_used:
            if shm.unlink(segment):
                self.stats["segments_reclaimed"] += 1

    # ---- control ---------------------------------------------------------------------------

    def _on_control(self, inst: Instance, control: Control) -> None:
        if control.op == "stats":
            self._send(inst.peer, Stats(f"broker:{self.broker_id}", self.snapshot()))
            return
        if control.target != "*" and control.target not in self.topology.stages():
            self.reject(inst.peer, f"control {control.op}: unknown target stage {truncate(control.target)!r}", "bad_control")
            return
        if control.op == "weights_ready":
            if control.version < 0:
                self.reject(inst.peer, f"weights_ready version {control.version}: must be >= 0", "bad_control")
                return
            self.policy_version = max(self.policy_version, control.version)
            self._dirty_queues.update(self.queues)
        elif control.op in ("pause", "resume"):
            stages = self.topology.stages() if control.target == "*" else {control.target}
            if control.op == "pause":
                self.paused |= stages
            else:
                self.paused -= stages
                self._dirty_queues.update(k for k in self.queues if k[1] in stages)
        elif control.op == "shutdown" and control.target == "*":
            self.begin_stop()  # the stages hear of it once the aligned consumers caught up
            return
        for other in self.instances.values():
            if other.stage != CONTROL_STAGE and control.target in ("*", other.stage):
                self._send(other.peer, control)

    def begin_stop(self) -> None:
        """The job stops: deliver only what the aligned consumers lack of each other's acks
        (`catch_up.py`), then tell every stage to shut down. Once; later calls do nothing."""
        self.stopping = True
        if self.catch_up is not None:
            return
        self.catch_up = CatchUp(self.topology)
        for stage in {s for stages in self.catch_up.aligned.values() for s in stages}:
            if not self._has_instance(stage):
                self.catch_up.give_up(stage)
        for entry in self.entries.values():
            self.catch_up.note(entry.handle, entry.pending)
        if self.catch_up.lacks:
            log.info("stopping: %s handle(s) a sibling acknowledged; the shutdown waits for them",
                     self.catch_up.describe())
            self._dirty_queues.update(self.queues)
        self._shut_down_once_caught_up()

    @property
    def catching_up(self) -> bool:
        return self.catch_up is not None and not self.shutdown_sent

    def end_catch_up(self) -> None:
        """Stop waiting for the catch-up (`stop_catch_up_s` passed): shut every stage down now."""
        if self.catching_up:
            log.warning("stopping: the catch-up ran out of time (%s; unacknowledged deliveries: %s): shutting down "
                        "without it, so the trainers may stop at different versions",
                        self.catch_up.describe() or "nothing lacked", self._aligned_in_flight() or "none")
            self.broadcast_shutdown()

    def _shut_down_once_caught_up(self) -> None:
        """Shutdown to every stage once no aligned consumer lacks a handle or holds an
        unacknowledged delivery of its aligned topic (acking it would leave its siblings lacking)."""
        if self.catching_up and not self.catch_up.lacks and not self._aligned_in_flight():
            if self.catch_up.lacked:
                log.info("stopping: the aligned consumers caught up (%s handle(s))", sum(self.catch_up.lacked.values()))
            self.broadcast_shutdown()

    def _aligned_in_flight(self) -> str:
        """`critic_train-0: 2` for each instance holding deliveries of a topic that aligns it."""
        held = {inst.instance_id: sum(self.catch_up.aligns(topic, inst.stage) for topic in inst.inflight.values())
                for inst in self.instances.values()}
        return ", ".join(f"{name}: {count}" for name, count in sorted(held.items()) if count)

    def broadcast_shutdown(self) -> None:
        """Tell every stage instance to drain and stop (the broker is stopping)."""
        self.shutdown_sent = True
        for inst in self.instances.values():
            if inst.stage != CONTROL_STAGE:
                self._send(inst.peer, Control("shutdown"))

    def _send(self, peer: bytes, message: Message) -> None:
        self._out.append((peer, message))

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
            self._route(handle, stages, joins)
        if live:
            self.stats["recovered"] = len(live)
            log.info("journal: recovered %d handle(s) in flight", len(live))


def _membership_level(stage: str) -> int:
    """Log level of an instance joining or leaving: control clients (stats, shutdown, the
    launcher's watch every few seconds) come and go quietly."""
    return logging.DEBUG if stage == CONTROL_STAGE else logging.INFO
