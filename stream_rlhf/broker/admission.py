"""Admission: whether the head of a broker queue may be delivered now.

The broker asks before every delivery; the answer may depend on the latest policy version
(announced by Control(weights_ready)). OverlapAdmission enforces the staleness bound: rollout
may run at most `overlap_depth` policy versions ahead of training.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from stream_rlhf.broker.messages import Handle


class Admission(Protocol):
    """Decides whether the head of a queue may be delivered now (overlap-depth enforcement)."""

    def admit(self, handle: Handle, stage: str, policy_version: int) -> bool: ...


class AdmitAll:
    def admit(self, handle: Handle, stage: str, policy_version: int) -> bool:
        return True


@dataclass(frozen=True)
class OverlapAdmission:
    """Handles of `topics` for iteration i are delivered only once policy_version >= i - depth:
    rollout runs at most `overlap_depth` policy versions ahead of training (0: on-policy)."""

    topics: frozenset[str]
    overlap_depth: int

    def admit(self, handle: Handle, stage: str, policy_version: int) -> bool:
        return handle.topic not in self.topics or handle.iteration - policy_version <= self.overlap_depth
