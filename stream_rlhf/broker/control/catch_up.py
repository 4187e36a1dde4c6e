"""At a stop, the consumers a topic aligns (`TopicConfig.align_at_stop`) first catch up with each other.

The trainers of an RL job (actor_train, critic_train) each receive every experience mini-batch
and train an iteration once they hold all of its mini-batches. Stopped at once, one of them may
have trained iteration n while the other still waits for its last mini-batch: the first saves
its part of checkpoint n, the second of n - 1, and the drain leaves no complete checkpoint to
resume from. So at a stop the broker delivers nothing new except, to each aligned consumer, the
handles of the topic that an aligned sibling has acknowledged and it has not; it tells the stages
to shut down once none lacks anything and none holds an unacknowledged delivery of the topic
(acking that would put its siblings behind), or once `BrokerConfig.stop_catch_up_s` has passed:

    stop asked ─► lacks[stage] = acked by a sibling, not by stage ─► deliver only those
                        ▲                                               │
                        └──── an ack by one leaves the others lacking ◄─┘
                  nothing lacked, nothing in flight ─► shutdown to every stage

A handle waits for the acks of every consumer stage, so the handles one sibling acknowledged and
another did not are those whose entry still owes acks from some of the aligned stages, not all.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from stream_rlhf.broker.control.messages import Handle
from stream_rlhf.broker.control.topology import Topology


class CatchUp:
    """What each aligned consumer stage lacks of what an aligned sibling has acknowledged."""

    def __init__(self, topology: Topology):
        self.aligned = {name: frozenset(t.align_at_stop) for name, t in topology.topics.items() if t.align_at_stop}
        """topic -> the consumer stages it aligns"""
        self.lacks: dict[str, set[str]] = {}
        """stage -> ids of the handles it still lacks"""
        self.lacked: Counter[str] = Counter()
        """stage -> handles it lacked since the stop began (for the log)"""
        self.gone: set[str] = set()
        """stages that cannot catch up: their last instance left"""

    def note(self, handle: Handle, owing: Iterable[str]) -> None:
        """`owing`: the consumers that still owe an ack of `handle` (after one acknowledged it, or
        at the stop for every live handle)."""
        aligned = self.aligned.get(handle.topic)
        if not aligned:
            return
        behind = aligned & set(owing)
        if not behind or behind == aligned:
            return
        for stage in behind - self.gone:
            ids = self.lacks.setdefault(stage, set())
            if handle.id not in ids:
                ids.add(handle.id)
                self.lacked[stage] += 1

    def aligns(self, topic: str, stage: str) -> bool:
        return stage in self.aligned.get(topic, ())

    def wants(self, stage: str, handle_id: str) -> bool:
        return handle_id in self.lacks.get(stage, ())

    def got(self, stage: str, handle_id: str) -> None:
        """`stage` acknowledged (or dropped) `handle_id`."""
        ids = self.lacks.get(stage)
        if ids is not None:
            ids.discard(handle_id)
            if not ids:
                del self.lacks[stage]

    def give_up(self, stage: str) -> None:
        """`stage` cannot catch up: its last instance left."""
        self.gone.add(stage)
        self.lacks.pop(stage, None)

    def describe(self) -> str:
        """`critic_train lacks 1 of 2` for each stage behind: what it lacks now of all it lacked."""
        return ", ".join(f"{stage} lacks {len(ids)} of {self.lacked[stage]}"
                         for stage, ids in sorted(self.lacks.items()))
