"""What every launcher shares: a stage's spec, its logging, how a failed stage restarts.

    spec = StageSpec("stream_rlhf.stages.rollout:RolloutStage", instances=2, kwargs={"job": job})
    stage = import_dotted(spec.cls, "cls")(**spec.kwargs)

The job and the dataflow import this module, never a launcher (`local.py`, `ray_job.py`), so
neither pulls in the machinery that starts processes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Annotated, Any

from msgspec import Meta

from stream_rlhf.backends.core_board import CoreLending
from stream_rlhf.config import ConfigError, check_fields
from stream_rlhf.weights.offload_config import OffloadPolicy

RESTART_BACKOFF_S = 0.5
"""The wait before a crashed instance's first restart; it doubles with each further restart."""


@dataclass(frozen=True)
class StageSpec:
    """One stage of a job: its class and arguments, its instances and ranks and where they run (a
    broker job's `stages.<name>`; the RL dataflow builds them from the RL config)."""

    cls: str
    """Stage class as "package.module:ClassName"."""
    instances: Annotated[int, Meta(ge=1)] = 1
    """Data-parallel instances; the broker hands each handle to the least-loaded one."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the class."""
    prefetch: Annotated[int, Meta(ge=1)] = 2
    """Handles delivered to an instance ahead of the one it is processing."""
    cores: list[int] | None = None
    """CPU cores the process is pinned to (os.sched_setaffinity); None: all."""
    threads: Annotated[int, Meta(ge=1)] | None = None
    """torch intra-op threads; None: torch's default."""
    restarts: Annotated[int, Meta(ge=0)] = 0
    """How often the launcher restarts a crashed instance before failing the job."""
    trace: str | None = None
    """Folder where each rank appends its trace events (`telemetry/trace.py`); None: no trace."""
    ranks: Annotated[int, Meta(ge=1)] = 1
    """Processes per instance, one torch.distributed group (gloo on CPU, NCCL on CUDA)."""
    devices: list[str] | None = None
    """The torch device of each rank (`cpu`, `cuda:N`); None: `cpu` for every rank."""
    rank_cores: list[list[int]] | None = None
    """The cores of each rank (with `threads` torch threads each); None: `cores` for every rank."""
    group_timeout_s: float = 3600.0
    """How long a rank waits in a collective (a follower waits this long for its leader's next handle)."""
    lending: CoreLending | None = None
    """Borrow the other side's cores while it is idle (`core_lending.py`; one-rank instances)."""
    offload: OffloadPolicy | None = None
    """What of its model state leaves the device between steps, and when (`weights/device_turns.py`)."""
    last_minibatch: int | None = None
    """The index of an iteration's last mini-batch (an offload policy's `iteration`)."""
    counts_dir: str | None = None
    """The run folder whose `stage_counts/` gets what its offload policy moved (None: counted, not written)."""

    def __post_init__(self) -> None:
        check_fields(self)
        if ":" not in self.cls:
            raise ConfigError(f"cls={self.cls!r}: expected 'package.module:ClassName'")
        for name in ("devices", "rank_cores"):
            value = getattr(self, name)
            if value is not None and len(value) != self.ranks:
                raise ConfigError(f"{name}={value}: one entry per rank, {self.ranks} rank(s)")

    def device(self, rank: int) -> str:
        return self.devices[rank] if self.devices else "cpu"

    def cores_of(self, rank: int) -> list[int] | None:
        return self.rank_cores[rank] if self.rank_cores else self.cores


class StageFailed(RuntimeError):
    """A stage process exited with an error; its traceback is on stderr above."""



def setup_logging(level: int = logging.INFO) -> None:
    logging.basicConfig(level=level, format="%(asctime)s %(processName)s %(levelname)s %(message)s")




def take_restart(restarts_left: dict[str, int], stage: str, spec: StageSpec) -> float | None:
    """Use up one of `stage`'s restarts: the back-off to wait before it (RESTART_BACKOFF_S, doubling
    with each restart), or None when it has none left. A stage that fails at start-up thus does not
    spin through its restarts."""
    if restarts_left.get(stage, 0) <= 0:
        return None
    restarts_left[stage] -= 1
    return RESTART_BACKOFF_S * 2 ** (spec.restarts - restarts_left[stage] - 1)
