"""Admission: whether the head of a broker queue may be delivered now.

The broker asks before every delivery; the answer may depend on the latest policy version
(announced by Control(weights_ready)). OverlapAdmission enforces the staleness bound: rollout
may run at most `overlap_depth` policy versions ahead of training. PhaseAdmission adds the
barriers of the `sync` schedule: a barrier topic's handles of iteration i are delivered only once
all of that iteration's mini-batches have been published on it (generate all, then forward all,
then train).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from stream_rlhf.broker.messages import Handle


class Admission(Protocol):
    """Decides whether the head of a queue may be delivered now (overlap-depth enforcement)."""

    def admit(self, handle: Handle, stage: str, policy_version: int) -> bool: ...

    def published(self, handle: Handle) -> None:
        """Told of every handle the broker routes (published, joined or replayed from the journal)."""


class AdmitAll:
    def admit(self, handle: Handle, stage: str, policy_version: int) -> bool:
        return True

    def published(self, handle: Handle) -> None:
        pass


@dataclass(frozen=True)
class OverlapAdmission:
    """Handles of `topics` for iteration i are delivered only once policy_version >= i - depth:
    rollout runs at most `overlap_depth` policy versions ahead of training (0: on-policy). A
    resumed run starts at `start_version`, the version its checkpoint holds."""

    topics: frozenset[str]
    overlap_depth: int
    start_version: int = 0

    def admit(self, handle: Handle, stage: str, policy_version: int) -> bool:
        version = max(policy_version, self.start_version)
        return handle.topic not in self.topics or handle.iteration - version <= self.overlap_depth

    def published(self, handle: Handle) -> None:
        pass


@dataclass
class PhaseAdmission:
    """OverlapAdmission plus per-iteration barriers on `barrier_topics` (the sync schedule).

    A broker restarted mid-iteration counts only the handles its journal replays, so a barrier
    whose first handles were already consumed before the crash does not open again: restart a
    sync job from its last finished iteration instead.
    """

    overlap: OverlapAdmission
    barrier_topics: frozenset[str]
    minibatches: int
    published_count: dict[tuple[str, int], int] = field(default_factory=dict)

    def admit(self, handle: Handle, stage: str, policy_version: int) -> bool:
        if not self.overlap.admit(handle, stage, policy_version):
            return False
        key = (handle.topic, handle.iteration)
        return handle.topic not in self.barrier_topics or self.published_count.get(key, 0) >= self.minibatches

    def published(self, handle: Handle) -> None:
        if handle.topic in self.barrier_topics:
            key = (handle.topic, handle.iteration)
            self.published_count[key] = self.published_count.get(key, 0) + 1
