"""Acks out: a handle is finished once every consumer stage (and join) acknowledged it; then its producer may free it.

    Ack from an instance ─► entry.pending -= its stage (journaled) ─► nothing pending:
        Release to the producer (or, if it is gone, its payload freed: `reclaim.py`);
        the handle's join parts each get their join's ack
    Nack(requeue) ─► back at the head of its queue, up to `max_attempts` deliveries per stage;
        past that, or without requeue, dropped for that stage (counted and logged)

While the job stops, each ack also tells the catch-up what the acking stage's aligned siblings
now lack (`catch_up.py`).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from stream_rlhf.broker.control.messages import Nack
from stream_rlhf.broker.control.reclaim import unlink_payload
from stream_rlhf.broker.control.state import JOIN, RECENT_IDS, Entry, Instance
from stream_rlhf.broker.control.stopping import shut_down_once_caught_up

if TYPE_CHECKING:
    from stream_rlhf.broker.control.core import BrokerCore


def on_ack(core: BrokerCore, inst: Instance, handle_id: str) -> None:
    if inst.inflight.pop(handle_id, None) is None:
        core.stats["stale_acks"] += 1
        return
    core.stats["acked"] += 1
    consumer_done(core, handle_id, inst.stage)


def on_nack(core: BrokerCore, inst: Instance, nack: Nack) -> None:
    topic = inst.inflight.pop(nack.handle_id, None)
    if topic is None:
        core.stats["stale_acks"] += 1
        return
    core.stats["nacked"] += 1
    entry = core.entries[nack.handle_id]
    if nack.requeue and entry.attempts.get(inst.stage, 0) < core.config.max_attempts:
        core.ratelog.log(logging.WARNING, "nack_requeued", "%s nacked %s (%s): requeued", inst.instance_id,
                         nack.handle_id, nack.reason)
        core.queues[(topic, inst.stage)].appendleft(nack.handle_id)
        core.dirty_queues.add((topic, inst.stage))
        shut_down_once_caught_up(core)
        return
    why = "poison" if nack.requeue else "rejected"
    core.stats[f"dropped.{why}"] += 1
    core.stats["dropped"] += 1
    core.ratelog.log(
        logging.ERROR, f"dropped.{why}", "handle %s (topic %s) dropped for stage %s after %d attempt(s): %s",
        nack.handle_id, topic, inst.stage, entry.attempts.get(inst.stage, 0), nack.reason,
    )
    consumer_done(core, nack.handle_id, inst.stage)


def consumer_done(core: BrokerCore, handle_id: str, consumer: str) -> None:
    entry = core.entries.get(handle_id)
    if entry is None or consumer not in entry.pending:
        return
    entry.pending.discard(consumer)
    if core.journal:
        core.journal.acked(handle_id, consumer)
    if core.catch_up is not None and not core.shutdown_sent:
        core.catch_up.got(consumer, handle_id)
        core.catch_up.note(entry.handle, entry.pending)  # the siblings that lack it now get it
        core.dirty_queues.update(k for k in core.queues if k[0] == entry.handle.topic)
        shut_down_once_caught_up(core)
    if not entry.pending:
        finish(core, entry)


def finish(core: BrokerCore, entry: Entry) -> None:
    handle = entry.handle
    del core.entries[handle.id]
    core.recent[handle.id] = None
    if len(core.recent) > RECENT_IDS:
        core.recent.popitem(last=False)
    core.stats["completed"] += 1
    for parent in handle.parents:
        consumer_done(core, parent, JOIN + handle.topic)
    if entry.producer == "broker":
        return
    peer = core.by_instance_id.get(entry.producer)
    if peer is not None:
        core.releases_to[peer].append(handle.id)
    else:
        unlink_payload(core, handle)
