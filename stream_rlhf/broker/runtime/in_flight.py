"""The inputs of a stage that works on several at once (`Stage.inputs_in_flight()` > 1), as its host
keeps them: those begun and not yet ended, in begin order, each with its in-flight position (the trace
track of its step), and the deliveries waiting, in order, for room among them.

A stage that steps on one input at a time has a limit of 1 and never an input in flight: its
deliveries pass through `waiting` straight to `StageHost.process`.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from stream_rlhf.broker.control.messages import Deliver
from stream_rlhf.stage import Batch, Stage


@dataclass
class InFlight:
    """An input begun and not yet ended."""

    batch: Batch
    begun_ns: int  # trace clock
    slot: int  # its in-flight position: its step goes on the trace track "input <slot>"


@dataclass
class InputsInFlight:
    limit: int = 1
    """Stage.inputs_in_flight(), once the stage is set up."""
    begun: dict[str, InFlight] = field(default_factory=dict)  # handle id -> input, in begin order
    waiting: deque[Deliver] = field(default_factory=deque)

    def __len__(self) -> int:
        return len(self.begun)

    def has_room(self) -> bool:
        """Whether another delivery may be taken now (always, for a stage that steps on one at a time)."""
        return self.limit == 1 or len(self.begun) < self.limit

    def add(self, batch: Batch, begun_ns: int) -> None:
        """`batch` begun at `begun_ns`, in the lowest free position."""
        used = {entry.slot for entry in self.begun.values()}
        slot = next(k for k in range(len(used) + 1) if k not in used)
        self.begun[batch.handle.id] = InFlight(batch, begun_ns, slot)

    def oldest(self) -> InFlight:
        return next(iter(self.begun.values()))


def inputs_in_flight(stage: Stage, stage_name: str, ranks: int) -> int:
    """`stage.inputs_in_flight()`, checked: at least 1, and 1 for an instance of several ranks."""
    inputs = stage.inputs_in_flight()
    if inputs < 1:
        raise ValueError(f"{stage_name}: inputs_in_flight()={inputs}: must be >= 1")
    if inputs > 1 and ranks > 1:
        raise ValueError(f"{stage_name}: inputs_in_flight()={inputs} is not supported for an instance of {ranks} "
                         "ranks (several inputs in flight need a single-rank instance)")
    return inputs
