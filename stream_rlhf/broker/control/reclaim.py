"""Freeing the shared-memory segments that producers gone from the job leave behind.

    a handle finished whose producer left ─► unlink_payload: its segments no live handle points into
    an instance left, not by stopping   ─► reclaim_dead: once its process is dead, the segments it
                                            created that no live handle points into (its pool,
                                            payloads it never published)

On the broker's host the broker unlinks them itself. On another host it cannot: it asks that host's
payload server (`payload/host_server.py`, named in the Hello of the host's instances) with a
Reclaim, queued in `core.reclaims` for the server loop to send off the loop
(`payload/remote_reclaim.py`); that server checks there that a dead process is dead. A host
without one keeps them until the job ends (the launcher's sweep of the host). Only this job's
segments (named with its shm_prefix) are ever unlinked: a handle naming another job's segment
does not make the broker unlink it.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from typing import TYPE_CHECKING

from stream_rlhf.broker.control.messages import Handle, Reclaim
from stream_rlhf.broker.control.state import Instance
from stream_rlhf.broker.payload import shm

if TYPE_CHECKING:
    from stream_rlhf.broker.control.core import BrokerCore

log = logging.getLogger(__name__)


def unlink_payload(core: BrokerCore, handle: Handle) -> None:
    """Free a payload whose producer is gone (crashed, or stopped before every ack). Small
    payloads share a segment, so one is unlinked only when no live handle points into it."""
    if handle.producer == "broker":
        return
    still_used = live_segments(core)
    gone: defaultdict[str, set[str]] = defaultdict(set)  # host -> segments
    for spec in handle.fields.values():
        where = spec.location
        if (where.kind == "shm" and shm.has_prefix(where.segment, core.config.shm_prefix)
                and where.segment not in still_used):
            gone[where.host].add(where.segment)
    for segment in gone.pop(core.host, ()):
        if shm.unlink(segment):
            core.stats["segments_reclaimed"] += 1
    for host, segments in gone.items():
        ask_host(core, host, Reclaim(segments=sorted(segments)))


def reclaim_dead(core: BrokerCore, inst: Instance) -> None:
    """An instance left without stopping: once its process is dead, the segments it created and
    no live handle points into go."""
    if not inst.pid:
        return
    if inst.host != core.host:
        keep = sorted(s for s in live_segments(core) if shm.creator_pid(s, core.config.shm_prefix) == inst.pid)
        ask_host(core, inst.host, Reclaim(dead_pid=inst.pid, keep=keep))
        return
    if shm.pid_alive(inst.pid):
        return
    still_used = live_segments(core)
    for name, owner in shm.list_segments(core.config.shm_prefix):
        if owner == inst.pid and name not in still_used and shm.unlink(name):
            core.stats["segments_reclaimed"] += 1


def live_segments(core: BrokerCore) -> set[str]:
    """Every segment a handle not yet finished points into."""
    return {spec.location.segment for e in core.entries.values() for spec in e.handle.fields.values()}


def ask_host(core: BrokerCore, host: str, request: Reclaim) -> None:
    """Queue `request` for `host`'s payload server, if the broker knows one."""
    endpoint = core.host_servers.get(host)
    if endpoint is None:
        log.debug("no payload server known on host %s: its segments stay until the job ends", host)
        return
    core.reclaims.append((endpoint, request))
