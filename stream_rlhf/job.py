"""A job config: the broker, the dataflow topics, the stage processes and the staleness bound.

    name: broker_demo
    overlap_depth: 1            # rollout may run this many policy versions ahead of training
    admission_topics: [prompts] # topics whose delivery the overlap depth gates
    broker: {...}               # BrokerConfig
    topics: {...}               # Topology.topics
    stages: {rollout: {cls: "pkg.mod:Class", instances: 2, kwargs: {...}}, ...}
"""

from __future__ import annotations

from dataclasses import dataclass, field

from stream_rlhf.broker.admission import OverlapAdmission
from stream_rlhf.broker.topology import BrokerConfig, TopicConfig, Topology
from stream_rlhf.config import ConfigError
from stream_rlhf.launch.local import StageSpec


@dataclass(frozen=True)
class JobConfig:
    name: str
    topics: dict[str, TopicConfig]
    stages: dict[str, StageSpec]
    broker: BrokerConfig = field(default_factory=BrokerConfig)
    overlap_depth: int = 1
    """How many policy versions rollout may run ahead of training (0: on-policy)."""
    admission_topics: list[str] = field(default_factory=list)
    """Topics gated by overlap_depth (the prompts that rollout consumes)."""
    timeout_s: float = 600.0
    """The run fails if it has not finished by then."""

    def __post_init__(self) -> None:
        if not self.name or "/" in self.name:
            raise ConfigError(f"name={self.name!r}: a non-empty folder name")
        Topology(self.topics)  # checks producers, consumers and joins
        if self.overlap_depth < 0:
            raise ConfigError(f"overlap_depth={self.overlap_depth}: must be >= 0")
        for topic in self.admission_topics:
            if topic not in self.topics:
                raise ConfigError(f"admission_topics: {topic!r} is not a topic")

    @property
    def topology(self) -> Topology:
        return Topology(self.topics)

    def admission(self) -> OverlapAdmission:
        return OverlapAdmission(frozenset(self.admission_topics), self.overlap_depth)
