"""One rank of one stage instance, run in this process: what every launcher's rank process does.

    run_stage("rollout", "rollout-0", spec, "tcp://127.0.0.1:5555", key_dir=None, prefix="srlhf")

Rank 0 attaches to the broker; the others follow it through their torch.distributed group
(`broker/rank_group.py`). The local launcher calls it in a spawned process, the Ray launcher in an
actor, `stream-rlhf stage` in the command's own process.

    run_device_group("forwards", 0, {"ref_forward": spec, "critic_forward": spec2}, address, None, "srlhf")

runs the stages of a device group (`placement.device_groups`) in this one process, taking turns on
its device (the local launcher's process of the group, or the Ray launcher's actor).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import TYPE_CHECKING

from stream_rlhf.broker.stage import Batch
from stream_rlhf.config import ConfigError
from stream_rlhf.launch.spec import StageSpec, load_class
from stream_rlhf.telemetry import trace
from stream_rlhf.telemetry.stage_counts import StageCounts
from stream_rlhf.weights.device_turns import DeviceTurns

if TYPE_CHECKING:
    from stream_rlhf.broker.runner import StageRunner
    from stream_rlhf.launch.core_lending import ThreadGovernor

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

    if not 0 <= rank < spec.ranks:
        raise ConfigError(f"rank={rank}: {instance_id} has ranks 0..{spec.ranks - 1}")
    if spec.ranks > 1 and not init_method:
        raise ConfigError(f"{instance_id}: a group of {spec.ranks} ranks needs a rendezvous (init_method)")
    _pin(spec, rank)
    if spec.trace is not None:
        trace.start(spec.trace, instance_id, f"rank {rank}")
    group = RankGroup.join(RankSpec(rank, spec.ranks, init_method, spec.device(rank), spec.group_timeout_s))
    log.info("%s: rank %d of %d on %s", instance_id, rank, spec.ranks, spec.device(rank))
    try:
        stage = load_class(spec.cls)(**spec.kwargs)
        # on CUDA every stage takes its (uncontended) turns, which report its peak device memory
        on_cuda = spec.device(rank).startswith("cuda")
        turns = DeviceTurns(spec.last_minibatch) if spec.offload is not None or on_cuda else None
        if rank > 0:
            transport = ShmTransport(prefix=prefix, serve=False, key_dir=key_dir)
            follower = GroupFollower(stage, stage_name, instance_id, group, transport, *_contexts(turns, stage_name))
            if turns is not None:
                turns.add(stage_name, stage, spec.offload, _offload_counts(spec, stage_name, instance_id, rank))
            follower.run()
            return
        governor = None
        if spec.lending is not None and spec.ranks == 1:
            governor = ThreadGovernor(spec.lending, int(instance_id.rsplit("-", 1)[1]), spec.cores_of(0) or [])
            governor.install()
        step_context, setup_context = _contexts(turns, stage_name, governor)
        runner = StageRunner(stage, stage_name, instance_id, address, key_dir, prefetch=spec.prefetch,
                             shm_prefix=prefix, group=group, step_context=step_context, setup_context=setup_context)
        if turns is not None:
            turns.add(stage_name, stage, spec.offload, _offload_counts(spec, stage_name, instance_id, rank))
        runner.run()
        if governor is not None:
            log.info("%s: borrowed the other side's cores %d times%s", instance_id, governor.borrowed,
                     "" if governor.may_borrow else " (no model big enough to gain from more threads)")
            governor.close()
    finally:
        group.close()


def run_device_group(group_name: str, index: int, members: dict[str, StageSpec], address: str, key_dir: str | None,
                     prefix: str) -> None:
    """Run instance `index` of every stage of a device group in this one process: each its own
    broker client (its own instance id and topics) on a thread of its own, all taking turns on one
    device (`weights/device_turns.py`). Returns once every member stopped; the first member that
    failed stops the others at once and its error is raised."""
    from stream_rlhf.broker.rank_group import RankGroup, RankSpec
    from stream_rlhf.broker.runner import StageRunner

    first = next(iter(members.values()))
    _pin(first, 0)
    process = f"{group_name}-{index}"
    if first.trace is not None:
        trace.start(first.trace, process, "rank 0")
    device = RankGroup.join(RankSpec(device=first.device(0))).device  # every member's models live there
    log.info("%s: %s in one process on %s", process, ", ".join(members), device)
    turns = DeviceTurns(first.last_minibatch)
    runners = {}
    for name, spec in members.items():
        stage = load_class(spec.cls)(**spec.kwargs)
        step_context, setup_context = _contexts(turns, name)
        runner = StageRunner(stage, name, f"{name}-{index}", address, key_dir, prefetch=spec.prefetch,
                             shm_prefix=prefix, group=RankGroup.single(device), step_context=step_context,
                             setup_context=setup_context)
        turns.add(name, stage, spec.offload, _offload_counts(spec, name, f"{name}-{index}", 0))
        runners[name] = runner
    _run_together(process, runners)


def _run_together(process: str, runners: dict[str, StageRunner]) -> None:
    """Each runner on a thread of its own; SIGTERM drains them all (a second stops them now) when
    this is the main thread (under Ray, where a worker may run its actor's calls on another, the
    broker's shutdown drains them)."""
    errors: dict[str, BaseException] = {}
    done = threading.Event()

    def run(name: str, runner: StageRunner) -> None:
        try:
            runner.run()
        except BaseException as exc:  # noqa: BLE001 - re-raised by the main thread, named
            errors[name] = exc
        finally:
            done.set()

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda *_: [r.request_stop() for r in runners.values()])
    threads = [threading.Thread(target=run, args=(name, runner), name=f"{name}-stage") for name, runner in runners.items()]
    for thread in threads:
        thread.start()
    while any(thread.is_alive() for thread in threads):
        done.wait(0.5)
        done.clear()
        if errors:
            for name, runner in runners.items():
                if name not in errors:
                    runner.request_stop()  # drain,
                    runner.request_stop()  # and stop now: the process fails anyway
            break
    for thread in threads:
        thread.join(30)
    if errors:
        name, error = next(iter(errors.items()))
        raise RuntimeError(f"{process}: {name} failed: {type(error).__name__}: {error}") from error


def _contexts(turns: DeviceTurns | None, stage_name: str, governor: ThreadGovernor | None = None) \
        -> tuple[Callable[[Batch | None], AbstractContextManager[None]], Callable[[], AbstractContextManager[None]]]:
    """(step context, setup context) of a stage: its device turn (offload policy), then its core
    lending's busy mark (so a stage waiting for the device lends its cores on)."""

    @contextmanager
    def step(batch: Batch | None) -> Iterator[None]:
        with turns.step(stage_name, batch) if turns is not None else nullcontext(), \
                governor.busy() if governor is not None else nullcontext():
            yield

    def setup() -> AbstractContextManager[None]:
        return turns.setup(stage_name) if turns is not None else nullcontext()

    return step, setup


def _offload_counts(spec: StageSpec, stage_name: str, instance_id: str, rank: int) -> StageCounts:
    """Where a rank counts what its offload policy moves: a stage counts file of its own, beside the
    stage's (`telemetry/stage_counts.py`), written when the spec names a run folder."""
    return StageCounts(spec.counts_dir or ".", stage_name, f"{instance_id}.rank{rank}.offload",
                       write=spec.counts_dir is not None)


def _pin(spec: StageSpec, rank: int) -> None:
    """This process's cores and torch threads, from the spec."""
    cores = spec.cores_of(rank)
    if cores is not None:
        os.sched_setaffinity(0, cores)
    if spec.threads is not None:
        import torch

        torch.set_num_threads(spec.threads)
