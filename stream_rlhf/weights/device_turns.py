"""The stages of one process taking turns on its device, with their offload policies applied.

    turns = DeviceTurns(last_minibatch=3)
    turns.add("ref_forward", ref_stage, OffloadPolicy(["params"], "switch"), StageCounts(run_dir, ...))
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

Each stage's counts (`telemetry/stage_counts.py`, summed into the run summary's `offload` block)
get `offloads`, `onloads`, `offload_bytes`, `onload_bytes`, `offload_s`, `onload_s` and, on CUDA,
the process's peak allocation (`telemetry/memory.py` CUDA_PEAK: the launcher gives every stage on
CUDA its turns, policy or not, for this); each move is an `offload` or
`onload` event on the stage's track of the trace. Nothing is prefetched yet:
every onload is paid inside the turn that needs it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from stream_rlhf.broker.stage import Batch, Stage
from stream_rlhf.telemetry import trace
from stream_rlhf.telemetry.memory import CUDA_PEAK, cuda_peak_mb
from stream_rlhf.telemetry.stage_counts import StageCounts
from stream_rlhf.weights.offload_config import OffloadPolicy

log = logging.getLogger(__name__)
COUNTERS = ("offloads", "onloads", "offload_bytes", "onload_bytes", "offload_s", "onload_s")


@dataclass
class _Member:
    stage: Stage
    policy: OffloadPolicy | None
    counts: StageCounts
    off: set[str] = field(default_factory=set)
    """What of its state is off the device now."""
    set_up: bool = False


class DeviceTurns:
    def __init__(self, last_minibatch: int | None = None):
        """`last_minibatch`: the index of an iteration's last mini-batch (policies with `iteration`)."""
        self.last_minibatch = last_minibatch
        self._lock = threading.Lock()
        self._members: dict[str, _Member] = {}

    def add(self, name: str, stage: Stage, policy: OffloadPolicy | None, counts: StageCounts) -> None:
        """Host `stage` under `name`; what it moves is counted in `counts`."""
        if policy is not None and policy.when == "iteration" and self.last_minibatch is None:
            raise ValueError(f"{name}: offload when=iteration needs last_minibatch")
        counts.add(**{key: 0 for key in COUNTERS})
        self._members[name] = _Member(stage, policy, counts)

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
        started = trace.now_ns()
        moved = sum(engine.offload(moving) for engine in member.stage.device_state())
        member.off |= moving
        ended = trace.now_ns()
        member.counts.add(offloads=1, offload_bytes=moved, offload_s=(ended - started) / 1e9)
        trace.complete("offload", "device", started, ended, stage=name, what=sorted(moving), bytes=moved)

    def _onload(self, name: str) -> None:
        member = self._members[name]
        if not member.off:
            return
        started = trace.now_ns()
        moved = sum(engine.onload(set(member.off)) for engine in member.stage.device_state())
        ended = trace.now_ns()
        trace.complete("onload", "device", started, ended, stage=name, what=sorted(member.off), bytes=moved)
        member.off.clear()
        member.counts.add(onloads=1, onload_bytes=moved, onload_s=(ended - started) / 1e9)

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
        if (peak := cuda_peak_mb()) is not None:
            member.counts.set_details(**{CUDA_PEAK: peak})


def offload_summary(counts: dict[str, dict[str, float]], policies: dict[str, OffloadPolicy | None]) \
        -> dict[str, dict[str, object]] | None:
    """The run summary's `offload` block from the stage counts (`read_stage_counts`): per stage with
    a policy, the policy and what moved each way (MB, seconds); None when no stage has one."""
    block = {}
    for stage, policy in policies.items():
        if policy is None:
            continue
        moved = counts.get(stage, {})
        block[stage] = {"policy": f"{'/'.join(policy.what)} when {policy.when}",
                        "offloads": int(moved.get("offloads", 0)), "onloads": int(moved.get("onloads", 0)),
                        "offload_mb": round(moved.get("offload_bytes", 0) / 2**20, 1),
                        "onload_mb": round(moved.get("onload_bytes", 0) / 2**20, 1),
                        "offload_s": round(moved.get("offload_s", 0), 3), "onload_s": round(moved.get("onload_s", 0), 3)}
    return block or None
