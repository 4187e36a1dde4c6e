"""One rank of one stage instance, run in this process: what every launcher's rank process does.

    run_stage("rollout", "rollout-0", spec, "tcp://127.0.0.1:5555", key_dir=None, prefix="srlhf")

Rank 0 attaches to the broker; the others follow it through their torch.distributed group
(`broker/rank_group.py`). The local launcher calls it in a spawned process, the Ray launcher in an
actor, `stream-rlhf stage` in the command's own process.
"""

from __future__ import annotations

import logging
import os
from contextlib import nullcontext

from stream_rlhf.config import ConfigError
from stream_rlhf.launch.spec import StageSpec, load_class
from stream_rlhf.telemetry import trace

log = logging.getLogger(__name__)


def run_stage(stage_name: str, instance_id: str, spec: StageSpec, address: str, key_dir: str | None, prefix: str,
              rank: int = 0, init_method: str | None = None) -> None:
    """Build the stage from its spec and run rank `rank` of the instance until it stops: rank 0
    attached to the broker at `address`, the others following it (`init_method`: the group's
    rendezvous URL, with `spec.ranks` > 1)."""
    from stream_rlhf.broker.group_follower import GroupFollower
    from stream_rlhf.broker.payload import ShmTransport
    from stream_rlhf.broker.rank_group import RankGroup, RankSpec
    from stream_rlhf.broker.runner import StageRunner
    from stream_rlhf.launch.core_lending import ThreadGovernor

    cores = spec.cores_of(rank)
    if cores is not None:
        os.sched_setaffinity(0, cores)
    if spec.threads is not None:
        import torch

        torch.set_num_threads(spec.threads)
    if not 0 <= rank < spec.ranks:
        raise ConfigError(f"rank={rank}: {instance_id} has ranks 0..{spec.ranks - 1}")
    if spec.ranks > 1 and not init_method:
        raise ConfigError(f"{instance_id}: a group of {spec.ranks} ranks needs a rendezvous (init_method)")
    if spec.trace is not None:
        trace.start(spec.trace, instance_id, f"rank {rank}")
    group = RankGroup.join(RankSpec(rank, spec.ranks, init_method, spec.device(rank), spec.group_timeout_s))
    log.info("%s: rank %d of %d on %s", instance_id, rank, spec.ranks, spec.device(rank))
    try:
        stage = load_class(spec.cls)(**spec.kwargs)
        if rank > 0:
            GroupFollower(stage, stage_name, instance_id, group, ShmTransport(prefix=prefix, serve=False)).run()
            return
        governor = None
        if spec.lending is not None and spec.ranks == 1:
            governor = ThreadGovernor(spec.lending, int(instance_id.rsplit("-", 1)[1]), spec.cores_of(0) or [])
            governor.install()
        StageRunner(
            stage, stage_name, instance_id, address, key_dir, prefetch=spec.prefetch, shm_prefix=prefix,
            group=group, step_context=governor.busy if governor else nullcontext,
        ).run()
        if governor is not None:
            log.info("%s: borrowed the other side's cores %d times%s", instance_id, governor.borrowed,
                     "" if governor.may_borrow else " (no model big enough to gain from more threads)")
            governor.close()
    finally:
        group.close()
