"""Credit in both directions: consumer credit lets a queue deliver, free queue room becomes producer credit.

The broker core (`core.py`) marks the queues and topics whose state changed while it handles
messages; at `flush` it calls `dispatch` for each marked queue and `grant_producer_credit` for
each marked topic:

    Request(topic, n) from a consumer ─► its credit += n ─► dispatch(queue[(topic, stage)])
        ─► Deliver the head to the least loaded instance with credit, if admission lets it
    delivery, join completion, a producer leaving ─► grant_producer_credit(topic)
        ─► Request(topic, n) to producers, sharing the topic's free room

While the job stops, only what the catch-up wants is delivered (`catch_up.py`) and producers get
no credit.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from stream_rlhf.broker.control.messages import Deliver, Request
from stream_rlhf.broker.control.state import Entry, Instance
from stream_rlhf.broker.ratelog import truncate

if TYPE_CHECKING:
    from stream_rlhf.broker.control.core import BrokerCore


def on_credit(core: BrokerCore, inst: Instance, request: Request) -> None:
    if request.topic not in core.topology.topics or inst.stage not in core.topology.topics[request.topic].consumers:
        core.reject(inst.peer, f"credit for topic {truncate(request.topic)!r}: stage {inst.stage} does not consume it",
                    "bad_topic")
        return
    if request.credits < 0:
        core.reject(inst.peer, f"credit {request.credits} for {request.topic}: must be >= 0", "bad_credit")
        return
    inst.credits[request.topic] = inst.credits.get(request.topic, 0) + request.credits
    core.dirty_queues.add((request.topic, inst.stage))


def dispatch(core: BrokerCore, key: tuple[str, str]) -> None:
    topic, stage = key
    queue = core.queues[key]
    if stage in core.paused:
        return
    if core.catch_up is not None:
        dispatch_catch_up(core, key)
        return
    while queue:
        entry = core.entries.get(queue[0])
        if entry is None or stage not in entry.pending:  # acked meanwhile (late ack)
            queue.popleft()
            continue
        if not core.admission.admit(entry.handle, stage, core.policy_version):
            return
        inst = least_loaded(core, stage, topic)
        if inst is None:
            return
        queue.popleft()
        deliver(core, inst, entry, key)


def dispatch_catch_up(core: BrokerCore, key: tuple[str, str]) -> None:
    """While stopping: only the handles `key`'s stage lacks of what an aligned sibling acked
    (wherever they are in the queue; admission let the sibling have them)."""
    if not core.catching_up:
        return
    topic, stage = key
    queue = core.queues[key]
    for handle_id in [h for h in queue if core.catch_up.wants(stage, h) and h in core.entries]:
        inst = least_loaded(core, stage, topic)
        if inst is None:
            return
        queue.remove(handle_id)
        deliver(core, inst, core.entries[handle_id], key)


def least_loaded(core: BrokerCore, stage: str, topic: str) -> Instance | None:
    """The instance of `stage` with credit on `topic` and the fewest handles in flight, if any."""
    candidates = [i for i in core.instances.values() if i.stage == stage and i.credits.get(topic, 0) > 0]
    return min(candidates, key=lambda i: len(i.inflight)) if candidates else None


def deliver(core: BrokerCore, inst: Instance, entry: Entry, key: tuple[str, str]) -> None:
    topic, stage = key
    inst.credits[topic] -= 1
    inst.inflight[entry.handle.id] = topic
    attempt = entry.attempts.get(stage, 0) + 1
    entry.attempts[stage] = attempt
    core.send(inst.peer, Deliver(entry.handle, attempt))
    core.stats["delivered"] += 1
    core.dirty_topics.add(topic)


def grant_producer_credit(core: BrokerCore, topic: str) -> None:
    """Share the free room of `topic` among its producers, each up to capacity // producers.

    Credit a producer holds beyond that share (taken while it had fewer peers: the first
    rollout instance to say hello gets the whole capacity) does not count against the others,
    and a producer out of credit gets what is free even below a chunk: it may be waiting, and
    its peers' credit may never be used. Two rollout instances deadlocked so: the late one
    waited for credit holding mini-batch 1 of an iteration, which therefore never trained, so
    no later prompts were admitted and the early one never published what would have freed
    room. The topic may hold that surplus beyond its capacity until it is used."""
    if topic not in core.topology.topics or core.topology.topics[topic].join or core.catch_up is not None:
        return
    producers = [i for i in core.instances.values() if topic in core.stage_outputs.get(i.stage, ())]
    if not producers:
        return
    config = core.topology.topics[topic]
    capacity = config.capacity or core.config.queue_capacity
    share = max(1, capacity // len(producers))
    backlog = max([len(core.queues[(topic, s)]) for s in config.consumers] + [0])
    waiting = 0 if config.capacity else sum(1 for parts in core.partials.values() if topic in parts)
    held = [i.granted.get(topic, 0) for i in producers]
    free = capacity - max(backlog, waiting) - sum(min(h, share) for h in held)
    if all(held) and free < min(core.credit_chunk, capacity):
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
        core.send(peer, Request(topic, credits))
