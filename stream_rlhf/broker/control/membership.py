"""Who is connected: the hello handshake, and what an instance leaving gives back.

    Hello ─► schema version and stage checked ─► Instance (a reconnect replaces the old one)
          ─► Ready (+ the current policy version) ─► its output topics may grant it credit
    Heartbeat("stopped"), a reconnect, or silence past `heartbeat_timeout_s` (`BrokerCore.tick`)
          ─► its deliveries requeued at the head of their queues (redelivered to another instance),
             its producer credit back to its peers, segments a dead producer left unpublished
             freed (`reclaim.py`; on another host by the payload server its Hello named), and a
             stopping job stops waiting for its stage to catch up
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from stream_rlhf.broker.control.messages import SCHEMA_VERSION, Control, Hello, Ready
from stream_rlhf.broker.control.reclaim import reclaim_dead
from stream_rlhf.broker.control.state import Instance
from stream_rlhf.broker.control.stopping import shut_down_once_caught_up
from stream_rlhf.broker.control.topology import CONTROL_STAGE
from stream_rlhf.broker.ratelog import truncate

if TYPE_CHECKING:
    from stream_rlhf.broker.control.core import BrokerCore

log = logging.getLogger(__name__)


def on_hello(core: BrokerCore, peer: bytes, hello: Hello, now: float) -> None:
    if hello.schema_version != SCHEMA_VERSION:
        core.reject(
            peer, f"schema version {hello.schema_version} != broker's {SCHEMA_VERSION}", "schema", fatal=True
        )
        return
    if hello.stage != CONTROL_STAGE and hello.stage not in core.topology.stages():
        known = ", ".join(sorted(core.topology.stages()))
        core.reject(peer, f"stage {truncate(hello.stage)!r} is not in the topology (stages: {known})", "unknown_stage",
                    fatal=True)
        return
    old = core.instances.get(peer) or core.instances.get(core.by_instance_id.get(hello.instance_id, b""))
    if old is not None:
        remove_instance(core, old, "reconnected")
    inst = Instance(peer, hello.stage, hello.instance_id, hello.pid, hello.host, now)
    if hello.payload_server.startswith("tcp://") and hello.host and hello.host != core.host:
        core.host_servers[hello.host] = hello.payload_server
    core.instances[peer] = inst
    core.by_instance_id[hello.instance_id] = peer
    inputs, outputs = core.topology.inputs_of(hello.stage), core.topology.outputs_of(hello.stage)
    ready = Ready(SCHEMA_VERSION, core.broker_id, core.config.heartbeat_interval_s, core.config.max_message_bytes,
                  inputs, outputs)
    core.send(peer, ready)
    if core.policy_version > 0:
        core.send(peer, Control("weights_ready", hello.stage, core.policy_version))
    core.dirty_topics.update(outputs)
    log.log(membership_level(hello.stage), "instance %s of stage %s joined (pid %d)", truncate(hello.instance_id),
            hello.stage, hello.pid)


def remove_instance(core: BrokerCore, inst: Instance, reason: str) -> None:
    core.instances.pop(inst.peer, None)
    if core.by_instance_id.get(inst.instance_id) == inst.peer:
        del core.by_instance_id[inst.instance_id]
    for handle_id, topic in reversed(list(inst.inflight.items())):
        key = (topic, inst.stage)
        core.queues[key].appendleft(handle_id)
        core.dirty_queues.add(key)
        core.stats["redelivered"] += 1
    if inst.inflight:
        log.warning(
            "instance %s (%s) left: %s; %d handle(s) in flight requeued",
            truncate(inst.instance_id), inst.stage, reason, len(inst.inflight),
        )
    else:
        log.log(membership_level(inst.stage), "instance %s (%s) left: %s", truncate(inst.instance_id), inst.stage,
                reason)
    core.dirty_topics.update(inst.granted)
    if core.catching_up:
        if not core.has_instance(inst.stage):
            core.catch_up.give_up(inst.stage)
        shut_down_once_caught_up(core)
    if reason != "stopped":
        reclaim_dead(core, inst)


def membership_level(stage: str) -> int:
    """Log level of an instance joining or leaving: control clients (stats, shutdown, the
    launcher's watch every few seconds) come and go quietly."""
    return logging.DEBUG if stage == CONTROL_STAGE else logging.INFO
