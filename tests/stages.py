"""Small stages for the multi-process tests (importable by spawned stage processes)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch

from stream_rlhf.broker.payload import shm
from stream_rlhf.stage import Batch, Output, Stage, StepAborted
from tests.waiting import wait_for


class CountingSource(Stage):
    """Emits `n` handles on `topic`: x = arange(size) + i, metadata index = i."""

    def __init__(self, n: int, topic: str = "items", size: int = 4, minibatches: int = 1_000_000):
        self.n, self.topic, self.size, self.minibatches = n, topic, size, minibatches
        self.i = 0

    def step(self, batch: Batch | None) -> list[Output] | None:
        if self.i >= self.n:
            return None
        i, self.i = self.i, self.i + 1
        x = torch.arange(self.size, dtype=torch.float32) + i
        return [Output(self.topic, {"x": x}, 1, iteration=i // self.minibatches,
                       minibatch=i % self.minibatches, metadata={"index": i})]


class GatedSource(CountingSource):
    """A CountingSource that publishes only once `readers` instances have written their ready
    file into `ready_dir` (see Worker), so that every reader is in from the first item."""

    def __init__(self, n: int, ready_dir: str, readers: int, timeout_s: float = 60.0):
        super().__init__(n)
        self.ready_dir, self.readers, self.timeout_s = Path(ready_dir), readers, timeout_s

    def setup(self, ctx) -> None:
        super().setup(ctx)
        wait_for(lambda: len(os.listdir(self.ready_dir)) >= self.readers, self.timeout_s,
                 f"{self.readers} ready files in {self.ready_dir}")


class Worker(Stage):
    """y = 2x on `out_topic`, after `delay_s`. Given `ready_dir`, writes a file named after the
    instance there once set up: by then its credit is at the broker (sent at handshake)."""

    def __init__(self, out_topic: str, delay_s: float = 0.0, field: str = "y", ready_dir: str | None = None):
        self.out_topic, self.delay_s, self.field, self.ready_dir = out_topic, delay_s, field, ready_dir

    def setup(self, ctx) -> None:
        super().setup(ctx)
        if self.ready_dir:
            (Path(self.ready_dir) / ctx.instance_id).touch()

    def step(self, batch: Batch | None) -> list[Output]:
        time.sleep(self.delay_s)
        return [Output(self.out_topic, {self.field: batch.tensors["x"] * 2}, batch.num_samples,
                       metadata={"index": batch.metadata["index"], "worker": self.ctx.instance_id})]


class PayloadLosingWorker(Worker):
    """A Worker that, before it takes anything, waits for the source's first segment of `prefix`
    and unlinks it (as a /dev/shm cleaner would): small payloads share that segment, so every
    one published into it is gone when this worker reads it."""

    def __init__(self, out_topic: str, prefix: str, timeout_s: float = 30.0):
        super().__init__(out_topic)
        self.prefix, self.timeout_s = prefix, timeout_s

    def setup(self, ctx) -> None:
        super().setup(ctx)
        segments = wait_for(lambda: shm.list_segments(self.prefix), self.timeout_s,
                            f"a shared-memory segment of prefix {self.prefix!r}")
        for name, _ in segments:
            shm.unlink(name)


class StuckWorker(Stage):
    """A consumer whose step never finishes on its own, as a rollout whose engine hangs: it
    writes `started` into `ready_dir` and waits until the instance is told to stop."""

    def __init__(self, ready_dir: str):
        self.ready_dir = Path(ready_dir)

    def step(self, batch: Batch | None) -> list[Output]:
        (self.ready_dir / "started").touch()
        self.ctx.stopping.wait()
        raise StepAborted(f"{self.ctx.instance_id}: gave up mini-batch {batch.minibatch}")


class SetupFails(Stage):
    """A stage whose setup() raises before it has what its close() reads (a trainer whose
    checkpoint folder cannot be read): close() then raises AttributeError too."""

    def setup(self, ctx) -> None:
        raise RuntimeError("no model at /nowhere")

    def close(self) -> None:
        self.engine.close()

    def step(self, batch: Batch | None) -> list[Output]:
        return []


class Sink(Stage):
    """Appends one JSON line per batch to `path`; sends shutdown after `expected` batches."""

    def __init__(self, path: str, expected: int, delay_s: float = 0.0):
        self.path, self.expected, self.delay_s = Path(path), expected, delay_s
        self.count = 0

    def step(self, batch: Batch | None) -> list[Output]:
        time.sleep(self.delay_s)
        record = {
            "id": batch.handle.id, "topic": batch.topic, "iteration": batch.iteration,
            "minibatch": batch.minibatch, "metadata": batch.metadata, "instance": self.ctx.instance_id,
            "pid": os.getpid(), "fields": {k: v.tolist() for k, v in batch.tensors.items()},
            "policy_version": batch.policy_version,
        }
        with open(self.path, "a") as out:
            out.write(json.dumps(record) + "\n")
        self.count += 1
        if self.count == self.expected:
            self.ctx.send_control("shutdown", -1)
        return []


def read_records(path: str | Path) -> list[dict]:
    """The complete lines of `path`: a Sink may be halfway through appending the last one."""
    path = Path(path)
    if not path.exists():
        return []
    complete, _, _ = path.read_text().rpartition("\n")
    return [json.loads(line) for line in complete.splitlines()]
