"""What the broker remembers of each stage instance and of each handle in flight (`core.py` holds them).

    Instance  one connected stage process: its consumer credit, the producer credit it holds,
              the deliveries it has not acknowledged, the counters it last reported
    Entry     one published handle: the consumers (and joins) that still owe an ack
"""

from __future__ import annotations

from dataclasses import dataclass, field

from stream_rlhf.broker.control.messages import Handle

RECENT_IDS = 200_000  # finished handle ids remembered to deduplicate late re-publishes
JOIN = "join:"  # pending-consumer names of joins, apart from stage names (which have no ":")


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
