"""The `Launcher` protocol: what carries out a job plan, and the table that picks one.

    launcher = make_launcher(plan)   # LocalJob (`launcher: local`) or RayJob (`launcher: ray`)
    launcher.start()                 # the broker, then every rank; returns the broker's address
    launcher.wait(timeout_s, watch)  # until every rank exited; StageFailed naming a failed one
    launcher.stop()                  # drain every rank, stop the broker; nothing outlives it

`stream-rlhf stage` runs one rank by hand with `HandRank` (`launch/by_hand.py`), under SLURM or
Kubernetes, where something else starts the other ranks and the broker.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import Protocol

from stream_rlhf.broker.control.client import ControlClient
from stream_rlhf.broker.control.topology import BrokerConfig
from stream_rlhf.launch.plan import JobPlan
from stream_rlhf.launch.spec import StageFailed

log = logging.getLogger(__name__)

STOP_GRACE_S = 15.0
"""How long a launcher waits for its ranks to leave once the stages were told to shut down."""


def stop_grace_s(broker: BrokerConfig) -> float:
    """How long after asking the broker to stop a launcher waits before it kills a rank: the
    trainers' catch-up (`broker/control/catch_up.py`) and then the drain."""
    return broker.stop_catch_up_s + STOP_GRACE_S


class Launcher(Protocol):
    address: str
    """The broker's address, once `start` returned."""
    failed: list[str]
    """The processes whose failure stopped the job ("broker" for the broker), once `wait` raised."""
    processes: Mapping[str, object]
    """The job's rank processes (or actors) by name: the instance id for rank 0, `<id>.rank<r>` after."""

    def start(self, timeout_s: float = 30.0) -> str: ...

    def wait(self, timeout_s: float, watch: Callable[[], None] | None = None, watch_every_s: float = 2.0) -> None: ...

    def stop(self, grace_s: float | None = None) -> None:
        """Drain every rank (killing those still running `grace_s` later; None: `stop_grace_s`)."""

    def client(self) -> ControlClient: ...

    def ask_shutdown(self) -> None:
        """Tell every stage to drain and stop (the job then exits as a finished one would)."""

    def fail_on_dropped_handles(self) -> None: ...


def fail_on_dropped_handles(address: str, key_dir: str | None) -> None:
    """A `wait` watch for jobs that need every handle (an RL iteration waits for all of its
    mini-batches): StageFailed as soon as the broker has dropped one, instead of a job that
    waits for it until its timeout. A broker that does not answer is left to `wait`."""
    try:
        with ControlClient(address, key_dir, timeout_s=2.0) as client:
            stats = client.stats()
    except Exception:  # noqa: BLE001 - a dead broker is reported by the process checks
        return
    dropped = int(stats.get("dropped", 0))
    if dropped:
        reasons = ", ".join(f"{k.removeprefix('dropped.')} {int(v)}" for k, v in sorted(stats.items())
                            if k.startswith("dropped."))
        raise StageFailed(f"the broker dropped {dropped} handle(s) ({reasons}; the reasons are in its log above): "
                          "the job cannot complete without them")


class BrokerClient:
    """What every launcher says to its job's broker (`address`, `key_dir`)."""

    address: str
    key_dir: str | None

    def client(self) -> ControlClient:
        return ControlClient(self.address, self.key_dir)

    def fail_on_dropped_handles(self) -> None:
        """A `wait` watch: StageFailed once the broker dropped a handle."""
        fail_on_dropped_handles(self.address, self.key_dir)

    def ask_shutdown(self) -> None:
        """Tell every stage through the broker to drain and stop (a dead broker is only logged)."""
        try:
            with ControlClient(self.address, self.key_dir, timeout_s=2.0) as client:
                client.control("shutdown")
        except Exception as exc:  # the broker may be the thing that died
            log.warning("could not send shutdown through the broker: %s", exc)


class Watch:
    """Calls a `wait` watch every `every_s` from a supervision loop; when it raises StageFailed,
    `stop` runs before the error goes on."""

    def __init__(self, watch: Callable[[], None] | None, every_s: float, stop: Callable[[], None]):
        self.watch, self.every_s, self.stop = watch, every_s, stop
        self.next = time.monotonic() + every_s

    def poll(self) -> None:
        if self.watch is None or time.monotonic() < self.next:
            return
        self.next = time.monotonic() + self.every_s
        try:
            self.watch()
        except StageFailed:
            self.stop()
            raise


def make_launcher(plan: JobPlan) -> Launcher:
    """The launcher `plan.launcher` names, built from the plan (nothing starts yet)."""
    if plan.launcher == "ray":
        from stream_rlhf.launch.ray_job import RayJob

        return RayJob(plan)
    from stream_rlhf.launch.local import LocalJob

    flow = plan.flow
    return LocalJob(flow.topology, flow.broker, flow.stages, flow.admission, flow.broker_cores, flow.trace_folder,
                    flow.device_groups)
