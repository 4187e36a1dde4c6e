"""Publishes in: producer credit spent, duplicates answered, each new handle queued for its consumers and joins.

    Publish ─► credit spent, Ack to the producer ─► entry{pending consumers} (journaled)
                                                 ├► queue[(topic, stage)] for each consumer stage
                                                 └► join partials ─► joined handle, admitted alike

A handle id seen before (live, or among the last `RECENT_IDS` finished) is a duplicate: acked and
counted, never queued twice. The joined handle of a join is published by the broker itself.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import msgspec

from stream_rlhf.broker.control.join import merge_parts
from stream_rlhf.broker.control.messages import Handle
from stream_rlhf.broker.control.state import JOIN, Entry, Instance
from stream_rlhf.broker.ratelog import truncate

if TYPE_CHECKING:
    from stream_rlhf.broker.control.core import BrokerCore


def on_publish(core: BrokerCore, inst: Instance, handle: Handle) -> None:
    """Every publish costs the producer one credit, a duplicate too (the producer spent one
    on it). Without credit a new handle is rejected and its payload released: the producer
    frees it, nothing is queued."""
    topic = core.topology.topics.get(handle.topic)
    if topic is None or inst.stage not in topic.producers:
        allowed = core.topology.outputs_of(inst.stage)
        core.reject(
            inst.peer, f"publish of handle {truncate(handle.id)} on topic {truncate(handle.topic)!r}: stage "
            f"{inst.stage} publishes only {allowed}", "bad_topic",
        )
        return
    existing = core.entries.get(handle.id)
    duplicate = existing is not None or handle.id in core.recent
    if inst.granted.get(handle.topic, 0) > 0:
        inst.granted[handle.topic] -= 1
    elif not duplicate:
        core.releases_to[inst.peer].append(handle.id)
        core.reject(
            inst.peer, f"publish of handle {truncate(handle.id)} on topic {handle.topic!r} without producer "
            "credit: not queued, its payload released", "no_credit",
        )
        return
    core.acks_to[inst.peer].append(handle.id)
    if duplicate:
        core.stats["duplicate_publishes"] += 1
        if existing is None or existing.producer != inst.instance_id:
            core.releases_to[inst.peer].append(handle.id)  # its copy of the payload is not needed
        return
    if handle.producer != inst.instance_id:
        handle = msgspec.structs.replace(handle, producer=inst.instance_id)
    admit(core, handle, inst.instance_id)


def admit(core: BrokerCore, handle: Handle, producer: str) -> None:
    topic = core.topology.topics[handle.topic]
    pending = [*topic.consumers, *(JOIN + j for j in core.topology.joins_of(handle.topic))]
    core.entries[handle.id] = Entry(handle, set(pending), producer)
    if core.journal:
        core.journal.published(handle, pending)
    core.stats["published"] += 1
    core.stats[f"published.{handle.topic}"] += 1
    route(core, handle, topic.consumers, core.topology.joins_of(handle.topic))


def route(core: BrokerCore, handle: Handle, stages: list[str], joins: list[str]) -> None:
    core.admission.published(handle)
    for stage in stages:
        key = (handle.topic, stage)
        core.queues[key].append(handle.id)
        core.stats["max_queue_depth"] = max(core.stats["max_queue_depth"], len(core.queues[key]))
        core.dirty_queues.add(key)
    for join in joins:
        add_part(core, join, handle)
    core.dirty_topics.add(handle.topic)


def add_part(core: BrokerCore, join: str, part: Handle) -> None:
    key = (join, part.iteration, part.minibatch)
    parts = core.partials.setdefault(key, {})
    if part.topic in parts:
        core.stats["join_duplicate_parts"] += 1
        core.ratelog.log(logging.WARNING, "join_duplicate_part", "join %s: second %s part for %s; the later one "
                         "waits for the next", join, part.topic, key[1:])
    parts[part.topic] = part.id
    order = core.topology.topics[join].join
    if all(p in parts for p in order):
        del core.partials[key]
        core.dirty_topics.update(order)  # parts no longer wait here: producers may get credit
        emit_join(core, join, [core.entries[parts[p]].handle for p in order])


def emit_join(core: BrokerCore, join: str, parts: list[Handle]) -> None:
    joined, collisions = merge_parts(join, parts)
    core.stats["join_field_collisions"] += collisions
    if len({p.num_samples for p in parts}) > 1:
        core.stats["join_sample_mismatch"] += 1
        core.ratelog.log(logging.WARNING, "join_sample_mismatch", "join %s: parts disagree on num_samples: %s",
                         join, str({p.topic: p.num_samples for p in parts}))
    core.stats["joins_emitted"] += 1
    admit(core, joined, "broker")
