"""One rank of a job plan, run in this process: the launcher of `stream-rlhf stage` (SLURM, k8s).

    rank = HandRank(plan, "actor_train", index=0, rank=1, broker="tcp://10.0.0.1:5555",
                    group="tcp://10.0.0.2:29500")
    rank.start(); rank.wait(timeout_s)    # returns once the broker stopped the rank

Something else starts the broker (`stream-rlhf broker CONFIG`, which also makes the dataset and
the warm start, once) and every other rank. A SLURM job step per stage, for instance:

    srun -N1 -n1 stream-rlhf broker job.yaml --set broker.address=tcp://0.0.0.0:5555 \\
         --set broker.curve.key_dir=keys &
    srun -N1 -n1 stream-rlhf stage job.yaml rollout --broker tcp://$BROKER_HOST:5555 &
    srun -N1 -n2 bash -c 'stream-rlhf stage job.yaml actor_train --broker tcp://$BROKER_HOST:5555 \\
         --rank $SLURM_PROCID --group tcp://$(scontrol show hostnames | head -1):29500'
"""

from __future__ import annotations

from collections.abc import Callable

from stream_rlhf.config import ConfigError
from stream_rlhf.launch.launcher import BrokerClient
from stream_rlhf.launch.plan import JobPlan
from stream_rlhf.launch.rank import run_stage
from stream_rlhf.launch.spec import StageFailed


class HandRank(BrokerClient):
    """The `Launcher` of a single rank: `wait` runs it here until the broker stops it."""

    def __init__(self, plan: JobPlan, stage: str, index: int, rank: int, broker: str, group: str | None):
        flow = plan.flow
        if stage not in flow.stages:
            raise ConfigError(f"stage {stage!r} is not in this job's stages ({', '.join(flow.stages)})")
        spec = flow.stages[stage]
        if not 0 <= index < spec.instances:
            raise ConfigError(f"--index {index}: {stage} has instances 0..{spec.instances - 1}")
        if plan.checkpoint is not None and not plan.checkpoint_ready:
            raise ConfigError(f"{plan.checkpoint}: the warm start is not there yet; the driver makes it once "
                              "(`stream-rlhf broker CONFIG` or `run`): start it before the stages")
        if not plan.dataset_ready:
            raise ConfigError(f"{plan.dataset}: the dataset is not written yet; the driver writes it once "
                              "(`stream-rlhf broker CONFIG` or `run`): start it before the stages")
        self.plan = plan
        self.stage, self.index, self.rank, self.group = stage, index, rank, group
        self.address = broker
        self.failed: list[str] = []
        instance = f"{stage}-{index}"
        self.processes = {instance if rank == 0 else f"{instance}.rank{rank}": self}

    @property
    def key_dir(self) -> str | None:
        curve = self.plan.flow.broker.curve
        return curve.key_dir if curve else None

    def start(self, timeout_s: float = 30.0) -> str:
        return self.address

    def wait(self, timeout_s: float, watch: Callable[[], None] | None = None, watch_every_s: float = 2.0) -> None:
        """Run the rank until the broker stops it (`timeout_s` and `watch` are the broker's business here)."""
        flow = self.plan.flow
        try:
            run_stage(self.stage, f"{self.stage}-{self.index}", flow.stages[self.stage], self.address, self.key_dir,
                      flow.broker.shm_prefix, self.rank, self.group)
        except (ConfigError, KeyboardInterrupt):
            raise
        except Exception as exc:
            self.failed = list(self.processes)
            raise StageFailed(f"{self.failed[0]} failed: {exc}") from exc

    def stop(self, grace_s: float | None = None) -> None:
        """Nothing to stop: the rank ran in this process and has returned."""
