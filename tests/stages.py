"""Small stages for the multi-process tests (importable by spawned stage processes)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch

from stream_rlhf.broker import shm
from stream_rlhf.broker.stage import Batch, Output, Stage


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


class Worker(Stage):
    """y = 2x on `out_topic`, after `delay_s`."""

    def __init__(self, out_topic: str, delay_s: float = 0.0, field: str = "y"):
        self.out_topic, self.delay_s, self.field = out_topic, delay_s, field

    def step(self, batch: Batch | None) -> list[Output]:
        time.sleep(self.delay_s)
        return [Output(self.out_topic, {self.field: batch.tensors["x"] * 2}, batch.num_samples,
                       metadata={"index": batch.metadata["index"], "worker": self.ctx.instance_id})]


class PayloadLosingWorker(Worker):
    """A Worker that, before it takes anything, unlinks every shared-memory segment of `prefix`
    (as a /dev/shm cleaner would): the payloads already published are gone when it reads them."""

    def __init__(self, out_topic: str, prefix: str, wait_s: float):
        super().__init__(out_topic)
        self.prefix, self.wait_s = prefix, wait_s

    def setup(self, ctx) -> None:
        super().setup(ctx)
        time.sleep(self.wait_s)  # the source publishes meanwhile
        for name, _ in shm.list_segments(self.prefix):
            shm.unlink(name)


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
    path = Path(path)
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
