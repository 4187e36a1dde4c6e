"""The order in which the members of a device group of several ranks take the device, the same on
every rank.

    order = TurnOrder(turn_group, ["ref_forward", "critic_forward"])   # one per group process
    turns = DeviceTurns(last_minibatch, order)    # rank 0: each turn it grants is sent to the others
                                                  # rank r: a member's turn waits until it is next

A group of several ranks runs rank r of every member in process r (`launch/rank.py`
run_device_group). A member's step runs collectives with the same member on the other ranks, so
every rank must step the same member at the same time: were rank 0 stepping ref_forward while
rank 1 let critic_forward take its device, each would wait for the other forever. Rank 0 decides:
its members' leaders get the deliveries and take its device lock in the order they come; each
time one takes it (a setup or a step), rank 0 broadcasts the member's index over `turn_group`, a
process group of its own, and the other ranks' members take their device in that sequence. The
collectives of one member's turn run over that member's own group, so a turn does not cross the
broadcasts of the next.
"""

from __future__ import annotations

import collections
import logging
import threading

import torch
import torch.distributed as dist

from stream_rlhf.distributed import RankGroup

log = logging.getLogger(__name__)
END = -1
"""The index rank 0 sends once its members stopped: no turn follows."""


class TurnsEnded(RuntimeError):
    """A member waited for a turn that will never come (rank 0 stopped or its channel failed)."""


class TurnOrder:
    def __init__(self, group: RankGroup, members: list[str]):
        """`group`: the turn channel, every rank of the device group; `members`: in the same order on
        every rank."""
        self.group = group
        self.members = list(members)
        self._due: collections.deque[int] = collections.deque()
        self._changed = threading.Condition()
        self._ended: str | None = None
        if not group.is_leader:
            threading.Thread(target=self._receive, name="turn-order", daemon=True).start()

    def wait_for(self, name: str) -> None:
        """Before a member takes the device lock: on rank r > 0 return once `name`'s turn is the
        next (rank 0 decides, so returns at once)."""
        if self.group.is_leader:
            return
        index = self.members.index(name)
        with self._changed:
            # once the turns ended, those still due are taken in order; one not among them never comes
            self._changed.wait_for(lambda: (self._due and self._due[0] == index)
                                   or (self._ended is not None and index not in self._due))
            if not self._due or self._due[0] != index:
                raise TurnsEnded(f"{name}: waited for its turn on rank {self.group.rank}, but {self._ended}")

    def granted(self, name: str) -> None:
        """Holding the device lock: on rank 0 `name` takes the device now, which the other ranks are
        told; on the others its turn is taken (only then the next member's wait ends, so no member
        can take the lock ahead of it)."""
        if self.group.is_leader:
            self._send(self.members.index(name))
            return
        with self._changed:
            self._due.popleft()
            self._changed.notify_all()

    def close(self) -> None:
        """Rank 0, once every member stopped: the other ranks' members get no more turns."""
        if self.group.is_leader:
            try:
                self._send(END)
            except Exception as exc:  # noqa: BLE001 - the other ranks are gone: they fail by themselves
                log.warning("could not tell the other ranks the turns ended: %s", exc)

    def _send(self, index: int) -> None:
        dist.broadcast(torch.tensor([index], dtype=torch.int64), src=0, group=self.group.process_group)

    def _receive(self) -> None:
        """The other ranks' thread: every turn rank 0 grants, in order, until END."""
        why = "rank 0 ended the turns"
        try:
            while True:
                index = torch.empty(1, dtype=torch.int64)
                dist.broadcast(index, src=0, group=self.group.process_group)
                if int(index.item()) == END:
                    break
                with self._changed:
                    self._due.append(int(index.item()))
                    self._changed.notify_all()
        except Exception as exc:  # noqa: BLE001 - said to every member waiting for a turn
            why = f"the turn channel failed: {type(exc).__name__}: {exc}"
        with self._changed:
            self._ended = why
            self._changed.notify_all()
