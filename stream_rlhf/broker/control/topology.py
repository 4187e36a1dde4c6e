"""The dataflow graph the broker routes by, and the broker's own settings, as config dataclasses.

    topics:
      rollout:    {producers: [rollout], consumers: [ref_forward, reward_forward]}
      ref_logp:   {producers: [ref_forward]}
      reward:     {producers: [reward_forward]}
      experience: {join: [rollout, ref_logp, reward], consumers: [actor_train]}

Every consumer *stage* of a topic gets every handle (fan-out); the instances of one stage compete
for them (least-loaded first). A join topic has no producers: the broker publishes one merged
handle when a handle of every part topic has arrived with the same (iteration, minibatch).
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from typing import Annotated
from urllib.parse import urlparse

from msgspec import Meta

from stream_rlhf.config import ConfigError, check_fields

CONTROL_STAGE = "_control"  # stage name of CLI / launcher clients: no topics, may send Control


@dataclass(frozen=True)
class TopicConfig:
    """One topic of the dataflow: who publishes on it, who receives it, or which topics it joins."""

    producers: list[str] = field(default_factory=list)
    """Stages allowed to publish on this topic (empty for a join topic)."""
    consumers: list[str] = field(default_factory=list)
    """Stages that each receive every handle of this topic."""
    join: list[str] = field(default_factory=list)
    """Part topics merged into this one by (iteration, minibatch); excludes `producers`."""
    capacity: Annotated[int, Meta(ge=1)] | None = None
    """Handles queued for this topic's consumers before its producers get no more credit (how far
    a producer may run ahead of them, e.g. the vision encoder's prefetch depth). None: the
    broker's `queue_capacity`, counting handles that wait in a join too. With a capacity of its
    own only the consumers' queues count: a handle waiting in a join waits for parts that those
    consumers produce, so they bound it."""
    align_at_stop: list[str] = field(default_factory=list)
    """Consumers that, when the job stops, first receive every handle of this topic that another of
    them has acknowledged (`catch_up.py`): the trainers end at one policy version, so the checkpoint
    a drain leaves is complete."""

    def __post_init__(self) -> None:
        check_fields(self)
        if self.capacity is not None and not self.consumers:
            raise ConfigError(f"capacity={self.capacity}: only a topic with consumers has a capacity")
        if self.join and self.producers:
            raise ConfigError(f"producers={self.producers}: a join topic has no producers")
        if not self.join and not self.producers:
            raise ConfigError("producers=[]: a topic needs producers or a join")
        if len(set(self.join)) != len(self.join):
            raise ConfigError(f"join={self.join}: a part is listed twice")
        if not set(self.align_at_stop) <= set(self.consumers):
            raise ConfigError(f"align_at_stop={self.align_at_stop}: only consumers ({self.consumers}) can be aligned")


@dataclass(frozen=True)
class CurveConfig:
    """CURVE encryption and authentication of the broker's sockets (`broker.curve`)."""

    key_dir: str
    """Folder written by `stream-rlhf keys DIR`: broker.key_secret, and authorized_clients/ with
    the public keys of the clients allowed in."""


@dataclass(frozen=True)
class BrokerConfig:
    """The broker process: where it binds, how it detects dead peers, how much it queues."""

    address: str = "tcp://127.0.0.1:*"
    """Where the broker binds; `*` as the port picks a free one (set a fixed port when stages are
    started by hand with `stream-rlhf stage ... --broker ADDR`). Anything but loopback or ipc://
    requires `curve`."""
    curve: CurveConfig | None = None
    """CURVE keys (`broker.curve.key_dir`); None: plain sockets, allowed on loopback and ipc:// only."""
    heartbeat_interval_s: Annotated[float, Meta(gt=0)] = 0.5
    """Both sides send a heartbeat this often."""
    heartbeat_timeout_s: Annotated[float, Meta(gt=0)] = 3.0
    """A peer silent this long is dead: its in-flight handles are redelivered."""
    handshake_timeout_s: Annotated[float, Meta(gt=0)] = 10.0
    """How long a stage waits for the broker's answer to its hello before it fails (is the broker
    running, are the CURVE keys right?)."""
    max_message_bytes: Annotated[int, Meta(ge=1)] = 1 << 20
    """Larger control messages are rejected, logged and counted."""
    queue_capacity: Annotated[int, Meta(ge=1)] = 16
    """Handles queued per (topic, consumer stage) before producers get no more credit."""
    max_attempts: Annotated[int, Meta(ge=1)] = 5
    """Deliveries of one handle before it is dropped as poison (counted, with reason)."""
    journal: str = ""
    """Append-only journal of handles in flight; a restarted broker replays it. Empty: none."""
    journal_fsync: bool = False
    """fsync the journal at each flush (once per broker loop turn): it then survives a machine crash,
    not only a broker crash, at the cost of a disk flush per turn."""
    shm_prefix: str = "srlhf"
    """Shared-memory segments of this job are named /{shm_prefix}_{pid}_{n}."""
    stop_catch_up_s: Annotated[float, Meta(ge=0)] = 30.0
    """At a stop, how long the consumers a topic aligns (the trainers) may take to catch up with
    each other before every stage is told to shut down anyway (`catch_up.py`); launchers wait this
    long more than their usual grace before they kill a stage."""

    def __post_init__(self) -> None:
        check_fields(self)
        if self.heartbeat_timeout_s < 2 * self.heartbeat_interval_s:
            raise ConfigError(
                f"heartbeat_timeout_s={self.heartbeat_timeout_s}: must be >= 2 * "
                f"heartbeat_interval_s ({self.heartbeat_interval_s})"
            )
        if not self.shm_prefix.isidentifier():
            raise ConfigError(f"shm_prefix={self.shm_prefix!r}: letters, digits and _ only")
        if needs_curve(self.address) and self.curve is None:
            raise ConfigError(
                f"address={self.address}: binding beyond loopback requires curve.key_dir "
                "(create keys with `stream-rlhf keys DIR`)"
            )


@dataclass(frozen=True)
class Topology:
    topics: dict[str, TopicConfig]

    def __post_init__(self) -> None:
        if not self.topics:
            raise ConfigError("topics={}: at least one topic is needed")
        parts_used = set()
        for name, topic in self.topics.items():
            for part in topic.join:
                if part not in self.topics:
                    raise ConfigError(f"topics.{name}.join: part {part!r} is not a topic")
                if part == name:
                    raise ConfigError(f"topics.{name}.join: a topic cannot join itself")
                parts_used.add(part)
            for stage in [*topic.producers, *topic.consumers]:
                if not stage or stage.startswith("_") or ":" in stage:
                    raise ConfigError(f"topics.{name}: stage name {stage!r} is empty, reserved (_) or has ':'")
        for name, topic in self.topics.items():
            if not topic.consumers and name not in parts_used:
                raise ConfigError(
                    f"topics.{name}.consumers=[]: no consumer and not part of a join, "
                    "its handles would pile up"
                )
        self._check_acyclic_joins()

    def _check_acyclic_joins(self) -> None:
        def visit(name: str, path: tuple[str, ...]) -> None:
            if name in path:
                raise ConfigError(f"topics.{name}.join: joins form a cycle {' -> '.join(path + (name,))}")
            for part in self.topics[name].join:
                visit(part, path + (name,))

        for name in self.topics:
            visit(name, ())

    def inputs_of(self, stage: str) -> list[str]:
        return [name for name, t in self.topics.items() if stage in t.consumers]

    def outputs_of(self, stage: str) -> list[str]:
        return [name for name, t in self.topics.items() if stage in t.producers]

    def joins_of(self, part: str) -> list[str]:
        """Join topics that take `part` as one of their parts."""
        return [name for name, t in self.topics.items() if part in t.join]

    def stages(self) -> set[str]:
        return {s for t in self.topics.values() for s in [*t.producers, *t.consumers]}


def needs_curve(address: str) -> bool:
    """True when `address` binds beyond this machine (anything but loopback TCP, ipc, inproc)."""
    parsed = urlparse(address)
    if parsed.scheme in ("ipc", "inproc"):
        return False
    host = parsed.hostname or ""
    if host == "localhost":
        return False
    try:
        return not ipaddress.ip_address(host).is_loopback
    except ValueError:
        return True  # an interface name or a hostname: not provably loopback
