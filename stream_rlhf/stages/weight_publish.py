"""How a trainer publishes each new version of its weights (`weights.publish`): the version's file in
the shared-memory store, its senders (rollout groups, another host's forward), then its
announcement (actor: Control(weights_ready)), all in one `write`, run either inside the iteration
or on a thread of its own while the next iteration trains.

    publisher = VersionPublisher(engine, publishes_in_background(cfg.weights, engine.device), "actor")
    publisher.publish(version, write, leader)   # write(weights, version): the leader's store, senders, announcement
    publisher.wait()                            # before a stop or the job's shutdown: the last version is out

In the background the trainer stops only for a host snapshot of the weights (`snapshot_weights`:
pinned copies that wait for the device once, from a GPU); the write of the file (0.3-0.7 s per
iteration for a 358M model in bf16 on an H200, bench/RESULTS.md) overlaps the next iteration.
Readers learn of a version only once it is written, as before: a forward stage that waits for a
version, or a rollout held by the staleness bound, waits as long as the write takes, never less.
One version at a time: a publish first waits for the one before it (its snapshot buffers are then
free), so versions are written and announced in order; a failed write raises from the next
`publish` or `wait`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from stream_rlhf.backends.train_engine import TrainEngine
from stream_rlhf.resume.background_writer import BackgroundWriter
from stream_rlhf.weights.sync_config import WeightSyncConfig

WriteVersion = Callable[[dict[str, Tensor], int], None]
"""(weights in Hugging Face names, on the host; version) -> None: what the leader does with a version."""


def publishes_in_background(cfg: WeightSyncConfig, device: torch.device) -> bool:
    """`weights.publish`: `auto` is background on a GPU; on the CPU the snapshot is a copy of the
    same bytes the write copies, so it would only move the work, and sync keeps the in-process bus of
    the tests (one thread steps every stage) seeing every announcement inside a step."""
    if cfg.publish == "auto":
        return device.type == "cuda"
    return cfg.publish == "background"


class VersionPublisher:
    def __init__(self, engine: TrainEngine, background: bool, name: str):
        self.engine = engine
        self.writer = BackgroundWriter(background, f"{name} weights publisher", kind="weights")

    @property
    def background(self) -> bool:
        return self.writer.background

    def publish(self, version: int, write: WriteVersion, leader: bool) -> None:
        """Every rank calls it (a sharded engine gathers the weights); the leader's `write` runs
        once the version before is out: now, or on the publisher's thread."""
        self.writer.wait()
        weights = self.engine.snapshot_weights() if self.background else self.engine.export_weights()
        if leader:
            self.writer.submit(version, lambda: write(weights, version))

    def wait(self) -> None:
        """Until the pending version is written and announced; raises what its write raised."""
        self.writer.wait()
