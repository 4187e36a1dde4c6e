"""The stages of one process taking turns on its device, with their offload policies applied.

    turns = DeviceTurns(last_minibatch=3)
    turns.add("ref_forward", ref_stage, OffloadPolicy(["params"], "switch"), runner.host.counters)
    with turns.setup("ref_forward"):          # the runner's setup context
        ref_stage.setup(ctx)
    with turns.step("ref_forward", batch):    # the runner's step context
        ref_stage.step(batch)

One lock per process: one stage computes at a time. A turn first takes the device from the other
stages whose policy is `switch` (a device group's members by default), brings back what this stage
had offloaded, steps, and then offloads what its own policy says after a `step`, or after the step
on an iteration's last mini-batch (`iteration`). A step that does not use the model
(`Stage.uses_device`: a trainer buffering a mini-batch) only takes the lock. Right after its setup a
stage with a policy offloads at once, so the members of a device group are never on the device
together (their peak is the largest one's, not the sum).

Each stage's runner counters get `offloads`, `onloads`, `offload_bytes`, `onload_bytes`,
`offload_s`, `onload_s` (they reach the run's summary with the other stage counters) and, on CUDA,
`cuda_peak_mb` (this process's peak allocation). Nothing is prefetched yet: every onload is paid
inside the turn that needs it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from stream_rlhf.broker.stage import Batch, Stage
from stream_rlhf.weights.offload_config import OffloadPolicy

log = logging.getLogger(__name__)
COUNTERS = ("offloads", "onloads", "offload_bytes", "onload_bytes", "offload_s", "onload_s")


@dataclass
class _Member:
    stage: Stage
    policy: OffloadPolicy | None
    counters: dict[str, float]
    off: set[str] = field(default_factory=set)
    """What of its state is off the device now."""
    set_up: bool = False


class DeviceTurns:
    def __init__(self, last_minibatch: int | None = None):
        """`last_minibatch`: the index of an iteration's last mini-batch (policies with `iteration`)."""
        self.last_minibatch = last_minibatch
        self._lock = threading.Lock()
        self._members: dict[str, _Member] = {}

    def add(self, name: str, stage: Stage, policy: OffloadPolicy | None, counters: dict[str, float]) -> None:
        """Host `stage` under `name`; its offload counters go into `counters` (its runner's)."""
        if policy is not None and policy.when == "iteration" and self.last_minibatch is None:
            raise ValueError(f"{name}: offload when=iteration needs last_minibatch")
        for key in COUNTERS:
            counters.setdefault(key, 0)
        self._members[name] = _Member(stage, policy, counters)

    @contextmanager
    def setup(self, name: str) -> Iterator[None]:
        """Around `name`'s setup: the others leave the device first; with a policy it leaves at once after."""
        with self._lock:
            self._take_device(name)
            yield
            member = self._members[name]
            member.set_up = True
            if member.policy is not None:
                self._offload(name, set(member.policy.what))
                self._say_what_moves(name)

    @contextmanager
    def step(self, name: str, batch: Batch | None) -> Iterator[None]:
        member = self._members[name]
        with self._lock:
            if not member.stage.uses_device(batch):
                yield
                return
            self._take_device(name)
            self._onload(name)
            yield
            policy = member.policy
            if policy is not None and (policy.when == "step" or policy.when == "iteration" and (
                    batch is None or batch.minibatch == self.last_minibatch)):
                self._offload(name, set(policy.what))
            self._note_peak(member)

    def _take_device(self, name: str) -> None:
        for other, member in self._members.items():
            if other != name and member.set_up and member.policy is not None and member.policy.when == "switch":
                self._offload(other, set(member.policy.what))

    def _offload(self, name: str, what: set[str]) -> None:
        member = self._members[name]
        moving = what - member.off
        if not moving:
            return
        started = time.perf_counter()
        moved = sum(engine.offload(moving) for engine in member.stage.device_state())
        member.off |= moving
        member.counters["offloads"] += 1
        member.counters["offload_bytes"] += moved
        member.counters["offload_s"] += time.perf_counter() - started

    def _onload(self, name: str) -> None:
        member = self._members[name]
        if not member.off:
            return
        started = time.perf_counter()
        moved = sum(engine.onload(set(member.off)) for engine in member.stage.device_state())
        member.off.clear()
        member.counters["onloads"] += 1
        member.counters["onload_bytes"] += moved
        member.counters["onload_s"] += time.perf_counter() - started

    def _say_what_moves(self, name: str) -> None:
        member = self._members[name]
        devices = {str(getattr(engine, "device", "cpu")) for engine in member.stage.device_state()}
        if devices <= {"cpu"}:
            log.info("%s: offload %s (when %s): its model is on the CPU, where that state already lives in host "
                     "memory, so nothing moves%s", name, "/".join(member.policy.what), member.policy.when,
                     " (sharing a process with " + ", ".join(n for n in self._members if n != name) + ")"
                     if len(self._members) > 1 else "")
        else:
            log.info("%s: offload %s (when %s) from %s to pinned host memory", name, "/".join(member.policy.what),
                     member.policy.when, ", ".join(sorted(devices)))

    @staticmethod
    def _note_peak(member: _Member) -> None:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            member.counters["cuda_peak_mb"] = torch.cuda.max_memory_allocated() / 2**20
