"""A job config: the broker, the dataflow topics, the stage processes and the staleness bound.

    name: broker_demo
    overlap_depth: 1            # rollout may run this many policy versions ahead of training
    admission_topics: [prompts] # topics whose delivery the overlap depth gates
    broker: {...}               # BrokerConfig
    topics: {...}               # Topology.topics
    stages: {rollout: {cls: "pkg.mod:Class", instances: 2, kwargs: {...}}, ...}

Each stage class is imported and its kwargs matched against its signature when the config builds,
so a class that does not import or a kwarg it does not take fails before any process starts.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Annotated

from msgspec import Meta

from stream_rlhf.broker.control.admission import OverlapAdmission
from stream_rlhf.broker.control.topology import BrokerConfig, TopicConfig, Topology
from stream_rlhf.config import ConfigError, check_fields, import_dotted
from stream_rlhf.launch.spec import StageSpec
from stream_rlhf.stage import Stage


@dataclass(frozen=True)
class JobConfig:
    """A broker job of hand-written stages (`stream-rlhf run configs/broker_demo.yaml`)."""

    name: str
    """The run's name: its folder under runs/ (no "/")."""
    topics: dict[str, TopicConfig]
    """Topic name -> its producers, consumers or join parts: the dataflow the broker routes by."""
    stages: dict[str, StageSpec]
    """Stage name -> its class, instances and kwargs; the names are those the topics use."""
    broker: BrokerConfig = field(default_factory=BrokerConfig)
    """The broker's own settings (`broker`)."""
    overlap_depth: Annotated[int, Meta(ge=0)] = 1
    """How many policy versions rollout may run ahead of training (0: on-policy)."""
    admission_topics: list[str] = field(default_factory=list)
    """Topics gated by overlap_depth (the prompts that rollout consumes)."""
    timeout_s: Annotated[float, Meta(gt=0)] = 600.0
    """The run fails if it has not finished by then."""

    def __post_init__(self) -> None:
        check_fields(self)
        if not self.name or "/" in self.name:
            raise ConfigError(f"name={self.name!r}: a non-empty folder name")
        Topology(self.topics)  # checks producers, consumers and joins
        for topic in self.admission_topics:
            if topic not in self.topics:
                raise ConfigError(f"admission_topics: {topic!r} is not a topic")
        for name, spec in self.stages.items():
            check_stage_class(f"stages.{name}", spec)

    @property
    def topology(self) -> Topology:
        return Topology(self.topics)

    def admission(self) -> OverlapAdmission:
        return OverlapAdmission(frozenset(self.admission_topics), self.overlap_depth)


def check_stage_class(key: str, spec: StageSpec) -> None:
    """The stage class of `spec` imports, is a Stage and takes exactly its kwargs (every required
    argument, no unknown one), checked before any process starts; errors name `key`.cls or
    `key`.kwargs.<argument>."""
    cls = import_dotted(spec.cls, f"{key}.cls")
    if not (isinstance(cls, type) and issubclass(cls, Stage)):
        raise ConfigError(f"{key}.cls={spec.cls!r}: not a Stage class")
    parameters = inspect.signature(cls).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return
    named = [n for n, p in parameters.items() if p.kind is not inspect.Parameter.VAR_POSITIONAL]
    for argument in spec.kwargs:
        if argument not in named:
            raise ConfigError(f"{key}.kwargs.{argument}: {spec.cls} takes no such argument "
                              f"(it takes {', '.join(named) or 'none'})")
    missing = [n for n in named if parameters[n].default is inspect.Parameter.empty and n not in spec.kwargs]
    if missing:
        raise ConfigError(f"{key}.kwargs: {spec.cls} needs {', '.join(missing)}")
