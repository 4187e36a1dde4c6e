"""How often a run checkpoints itself and how many checkpoints it keeps (`checkpoint:` in an RL
config); the checkpoints are `runs/<name>/checkpoints/` (`resume/store.py`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from msgspec import Meta

from stream_rlhf.config import check_fields


@dataclass(frozen=True)
class CheckpointConfig:
    """When the run saves its state for `stream-rlhf run --resume` (`checkpoint`)."""

    every: Annotated[int, Meta(ge=0)] = 10
    """Checkpoint after every this many training iterations (and after the last one, and when a
    run is stopped); 0: only after the last one and at a stop."""
    keep: Annotated[int, Meta(ge=1)] = 2
    """The newest complete checkpoints kept; older ones are deleted once a newer one is complete."""
    keep_generated: bool = True
    """Keep rollout's outputs on disk until a checkpoint covers them, so that a resumed run trains
    what the stopped one generated instead of generating it again (`stages/generated_store.py`)."""
    background: bool = True
    """Write a checkpoint in the background: training stops only for a snapshot of the trainers'
    state (a host copy), then goes on while a thread writes, checksums and publishes it; a save
    waits for the write before it, and a stop for the last (`resume/background_writer.py`).
    false: training waits for the whole write."""
    recoveries: Annotated[int, Meta(ge=0)] = 2
    """How often a run whose stage failed (a crash the launcher could not restart, e.g. a trainer)
    resumes itself from its newest checkpoint before it fails for good."""

    def __post_init__(self) -> None:
        check_fields(self)

    def due(self, version: int, iterations: int) -> bool:
        """Whether the state after `version` training iterations is checkpointed."""
        return version == iterations or (self.every > 0 and version % self.every == 0)
