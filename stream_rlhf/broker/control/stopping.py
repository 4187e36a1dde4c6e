"""The broker's side of a stop: the aligned consumers catch up (`catch_up.py`), then every stage is told to shut down.

    begin_stop ─► CatchUp noted from every live entry ─► dispatch delivers only what it wants
         ▲                                                   (`dispatch.dispatch_catch_up`)
    acks, nacks, instances leaving ─► shut_down_once_caught_up ─► broadcast_shutdown
    end_catch_up (`stop_catch_up_s` passed, the server's clock) ─────────────┘

From `begin_stop` on producers get no credit; after `broadcast_shutdown` acks no longer feed
the catch-up.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from stream_rlhf.broker.control.catch_up import CatchUp
from stream_rlhf.broker.control.messages import Control
from stream_rlhf.broker.control.topology import CONTROL_STAGE

if TYPE_CHECKING:
    from stream_rlhf.broker.control.core import BrokerCore

log = logging.getLogger(__name__)


def begin_stop(core: BrokerCore) -> None:
    """The job stops: deliver only what the aligned consumers lack of each other's acks
    (`catch_up.py`), then tell every stage to shut down. Once; later calls do nothing."""
    core.stopping = True
    if core.catch_up is not None:
        return
    core.catch_up = CatchUp(core.topology)
    for stage in {s for stages in core.catch_up.aligned.values() for s in stages}:
        if not core.has_instance(stage):
            core.catch_up.give_up(stage)
    for entry in core.entries.values():
        core.catch_up.note(entry.handle, entry.pending)
    if core.catch_up.lacks:
        log.info("stopping: %s handle(s) a sibling acknowledged; the shutdown waits for them",
                 core.catch_up.describe())
        core.dirty_queues.update(core.queues)
    shut_down_once_caught_up(core)


def end_catch_up(core: BrokerCore) -> None:
    """Stop waiting for the catch-up (`stop_catch_up_s` passed): shut every stage down now."""
    if core.catching_up:
        log.warning("stopping: the catch-up ran out of time (%s; unacknowledged deliveries: %s): shutting down "
                    "without it, so the trainers may stop at different versions",
                    core.catch_up.describe() or "nothing lacked", aligned_in_flight(core) or "none")
        broadcast_shutdown(core)


def shut_down_once_caught_up(core: BrokerCore) -> None:
    """Shutdown to every stage once no aligned consumer lacks a handle or holds an
    unacknowledged delivery of its aligned topic (acking it would leave its siblings lacking)."""
    if core.catching_up and not core.catch_up.lacks and not aligned_in_flight(core):
        if core.catch_up.lacked:
            log.info("stopping: the aligned consumers caught up (%s handle(s))", sum(core.catch_up.lacked.values()))
        broadcast_shutdown(core)


def aligned_in_flight(core: BrokerCore) -> str:
    """`critic_train-0: 2` for each instance holding deliveries of a topic that aligns it."""
    held = {inst.instance_id: sum(core.catch_up.aligns(topic, inst.stage) for topic in inst.inflight.values())
            for inst in core.instances.values()}
    return ", ".join(f"{name}: {count}" for name, count in sorted(held.items()) if count)


def broadcast_shutdown(core: BrokerCore) -> None:
    """Tell every stage instance to drain and stop (the broker is stopping)."""
    core.shutdown_sent = True
    for inst in core.instances.values():
        if inst.stage != CONTROL_STAGE:
            core.send(inst.peer, Control("shutdown"))
