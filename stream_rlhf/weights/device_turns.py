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

A device group of several ranks (one process per rank, each hosting that rank of every member)
takes its turns in rank 0's order on every rank (`order`, `weights/turn_order.py`).

Each stage's counts (`telemetry/stage_counts.py`, summed into the run summary's `offload` block)
get `offloads`, `onloads`, `offload_bytes`, `onload_bytes`, `offload_s`, `onload_s` and, on CUDA,
the process's peak allocation (`telemetry/memory.py` CUDA_PEAK: the launcher gives every stage on
CUDA its turns, policy or not, for this); each move is an `offload` or
`onload` event on the stage's track of the trace.

Prefetch (`prefetch: true`, device groups): a stage whose step is due while another member holds
the device starts bringing its state back at once, in a thread on a side CUDA stream, so the
copies run during the other member's computation; its turn then waits only for what is left of
them. What the wait did not see is counted as `onload_hidden_s` (the prefetch's time before the
turn began), the rest as paid in the turn. A stage that takes the device joins any prefetch of a
stage it moves first, so every move of one stage's state happens in order.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field

import torch

from stream_rlhf.stage import Batch, Stage
from stream_rlhf.telemetry import trace
from stream_rlhf.telemetry.memory import CUDA_PEAK, cuda_peak_mb
from stream_rlhf.telemetry.stage_counts import StageCounts
from stream_rlhf.weights.offload_config import OffloadPolicy
from stream_rlhf.weights.turn_order import TurnOrder

log = logging.getLogger(__name__)
COUNTERS = ("offloads", "onloads", "offload_bytes", "onload_bytes", "offload_s", "onload_s", "prefetches",
            "onload_hidden_s")


@dataclass
class _Member:
    stage: Stage
    policy: OffloadPolicy | None
    counts: StageCounts
    off: set[str] = field(default_factory=set)
    """What of its state is off the device now."""
    set_up: bool = False
    prefetch: threading.Thread | None = None
    """The onload running ahead of this stage's turn, if any (`_start_prefetch`)."""
    prefetch_span: tuple[int, int] = (0, 0)
    """When the last prefetch started and ended (trace clock, ns)."""


class DeviceTurns:
    def __init__(self, last_minibatch: int | None = None, order: TurnOrder | None = None):
        """`last_minibatch`: the index of an iteration's last mini-batch (policies with `iteration`);
        `order`: the turn order of a device group of several ranks (None: turns as they come)."""
        self.last_minibatch = last_minibatch
        self.order = order
        self._lock = threading.Lock()
        self._members: dict[str, _Member] = {}
        self._side_streams: dict[torch.device, torch.cuda.Stream] = {}

    def add(self, name: str, stage: Stage, policy: OffloadPolicy | None, counts: StageCounts) -> None:
        """Host `stage` under `name`; what it moves is counted in `counts`."""
        if policy is not None and policy.when == "iteration" and self.last_minibatch is None:
            raise ValueError(f"{name}: offload when=iteration needs last_minibatch")
        counts.add(**{key: 0 for key in COUNTERS})
        self._members[name] = _Member(stage, policy, counts)

    @contextmanager
    def setup(self, name: str) -> Iterator[None]:
        """Around `name`'s setup: the others leave the device first; with a policy it leaves at once after."""
        with self._turn(name):
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
        if member.policy is not None and member.policy.prefetch and member.off and member.stage.uses_device(batch) \
                and self._lock.locked():
            self._start_prefetch(name)
        with self._turn(name):
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

    @contextmanager
    def _turn(self, name: str) -> Iterator[None]:
        """The device lock for `name`, in rank 0's order when the group has several ranks."""
        if self.order is not None:
            self.order.wait_for(name)
        with self._lock:
            if self.order is not None:
                self.order.granted(name)
            yield

    def _take_device(self, name: str) -> None:
        for other, member in self._members.items():
            if other != name and member.set_up and member.policy is not None and member.policy.when == "switch":
                self._offload(other, set(member.policy.what))

    def _offload(self, name: str, what: set[str]) -> None:
        member = self._members[name]
        self._join_prefetch(member)
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
        """Brings back what `name` has off the device, in its turn: what a prefetch did not finish
        before the turn began is paid here, the rest was hidden."""
        member = self._members[name]
        if member.prefetch is not None:
            turn = trace.now_ns()
            self._join_prefetch(member)
            started, ended = member.prefetch_span
            member.counts.add(onload_hidden_s=(min(ended, turn) - started) / 1e9)
        if not member.off:
            return
        started = trace.now_ns()
        moved = sum(engine.onload(set(member.off)) for engine in member.stage.device_state())
        ended = trace.now_ns()
        trace.complete("onload", "device", started, ended, stage=name, what=sorted(member.off), bytes=moved)
        member.off.clear()
        member.counts.add(onloads=1, onload_bytes=moved, onload_s=(ended - started) / 1e9)

    def _start_prefetch(self, name: str) -> None:
        """Bring `name`'s state back in a thread while another member holds the device."""
        member = self._members[name]
        if member.prefetch is not None:
            return

        def run() -> None:
            started = trace.now_ns()
            with self._side_stream(member):
                moved = sum(engine.onload(set(member.off)) for engine in member.stage.device_state())
            ended = trace.now_ns()
            trace.complete("onload", "device", started, ended, stage=name, what=sorted(member.off), bytes=moved,
                           prefetch=True)
            member.off.clear()
            member.prefetch_span = (started, ended)
            member.counts.add(onloads=1, prefetches=1, onload_bytes=moved, onload_s=(ended - started) / 1e9)

        member.prefetch = threading.Thread(target=run, name=f"prefetch-{name}", daemon=True)
        member.prefetch.start()

    @staticmethod
    def _join_prefetch(member: _Member) -> None:
        if member.prefetch is not None:
            member.prefetch.join()
            member.prefetch = None

    def _side_stream(self, member: _Member) -> AbstractContextManager:
        """The side CUDA stream of the member's device (one per device), or nothing off CUDA."""
        devices = {getattr(engine, "device", torch.device("cpu")) for engine in member.stage.device_state()}
        cuda = [d for d in devices if d.type == "cuda"]
        if not cuda:
            return nullcontext()
        if cuda[0] not in self._side_streams:
            self._side_streams[cuda[0]] = torch.cuda.Stream(cuda[0])
        return torch.cuda.stream(self._side_streams[cuda[0]])

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
        """The process's CUDA peak into the stage's counts file, written only when it rose (a peak
        only grows): not a file write per step."""
        if (peak := cuda_peak_mb()) is not None and peak != member.counts.details.get(CUDA_PEAK):
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
        block[stage] = {"policy": policy.describe(),
                        "offloads": int(moved.get("offloads", 0)), "onloads": int(moved.get("onloads", 0)),
                        "offload_mb": round(moved.get("offload_bytes", 0) / 2**20, 1),
                        "onload_mb": round(moved.get("onload_bytes", 0) / 2**20, 1),
                        "offload_s": round(moved.get("offload_s", 0), 3),
                        "onload_s": round(moved.get("onload_s", 0), 3),
                        **({"prefetches": int(moved.get("prefetches", 0)),
                            "onload_hidden_s": round(moved.get("onload_hidden_s", 0), 3)} if policy.prefetch else {})}
    return block or None
