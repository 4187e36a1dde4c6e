"""The core board of core lending (`core_lending.py`): which stage instances are in a step.

    lending = CoreLending(board="runs/<name>/core_board", slots=6, first_slot=4, lender_cores=(0,))
    board = CoreBoard(lending.board, lending.slots)
    board.set(slot, True)                   # this instance steps
    board.any_busy((0, 1, 2))               # do any of these?

One byte per stage instance in a small file every stage process of the job maps (the run folder
keeps it; it is rewritten by the next run of the same name). Each instance writes only its own
byte, so no lock is needed. No torch here: the launcher's StageSpec carries a CoreLending.
"""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass


@dataclass(frozen=True)
class CoreLending:
    """One stage's part in core lending (`StageSpec.lending`, set by the RL dataflow)."""

    board: str
    """The board file every stage process of the job maps."""
    slots: int
    """Bytes on the board: one per stage instance that takes part."""
    first_slot: int
    """Instance i of the stage writes slot first_slot + i."""
    lender_cores: tuple[int, ...]
    """The other side's cores, borrowed while no other instance on the board is in a step."""

    def __post_init__(self) -> None:
        if not 0 <= self.first_slot < self.slots:
            raise ValueError(f"first_slot={self.first_slot}: must lie in [0, slots={self.slots})")


class CoreBoard:
    """The board file mapped into this process: one byte per slot, 1 while its instance steps."""

    def __init__(self, path: str, slots: int):
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size < slots:
                os.ftruncate(fd, slots)  # every process does it: the same size, whoever comes first
            self._map = mmap.mmap(fd, slots)
        finally:
            os.close(fd)

    def set(self, slot: int, busy: bool) -> None:
        self._map[slot] = int(busy)

    def any_busy(self, slots: tuple[int, ...]) -> bool:
        return any(self._map[s] for s in slots)

    def close(self) -> None:
        self._map.close()
