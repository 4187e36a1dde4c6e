"""One rank of one stage instance, run in this process: what every launcher's rank process does.

    run_stage("rollout", "rollout-0", spec, "tcp://127.0.0.1:5555", key_dir=None, prefix="srlhf")

Rank 0 attaches to the broker; the others follow it through their torch.distributed group
(`distributed.py`). The local launcher calls it in a spawned process, the Ray launcher in an
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

from stream_rlhf.config import ConfigError, import_dotted
from stream_rlhf.launch.spec import StageSpec
from stream_rlhf.stage import Batch
from stream_rlhf.telemetry import trace
from stream_rlhf.telemetry.stage_counts import StageCounts
from stream_rlhf.weights.device_turns import DeviceTurns
from stream_rlhf.weights.turn_order import TurnOrder
from stream_rlhf.worker_process import HELPER_CORES

if TYPE_CHECKING:
    from stream_rlhf.backends.core_lending import ThreadGovernor
    from stream_rlhf.distributed import RankGroup

log = logging.getLogger(__name__)


def run_stage(stage_name: str, instance_id: str, spec: StageSpec, address: str, key_dir: str | None, prefix: str,
              rank: int = 0, init_method: str | None = None) -> None:
    """Build the stage from its spec and run rank `rank` of the instance until it stops: rank 0
    attached to the broker at `address`, the others following it (`init_method`: the group's
    rendezvous URL, with `spec.ranks` > 1)."""
    from stream_rlhf.backends.core_lending import ThreadGovernor
    from stream_rlhf.broker.payload.transport import ShmTransport
    from stream_rlhf.broker.runtime.group_follower import GroupFollower
    from stream_rlhf.broker.runtime.runner import StageRunner
    from stream_rlhf.distributed import RankGroup, RankSpec

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
        stage = import_dotted(spec.cls, "cls")(**spec.kwargs)
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
                     prefix: str, rank: int = 0, init_method: str | None = None) -> None:
    """Run instance `index` of every stage of a device group in this one process: each its own
    broker client (its own instance id and topics) on a thread of its own, all taking turns on one
    device (`weights/device_turns.py`). Members of several ranks (`spec.ranks`, the same for each;
    `init_method`: the group's rendezvous) run rank `rank` of every member here: on rank 0 they are
    the broker clients, on the others they follow them, each member over a process group of its
    own, and every rank takes its turns in rank 0's order (`weights/turn_order.py`). Returns once
    every member stopped; the first member that failed stops the others at once and its error is
    raised."""
    from stream_rlhf.broker.payload.transport import ShmTransport
    from stream_rlhf.broker.runtime.group_follower import GroupFollower
    from stream_rlhf.broker.runtime.runner import StageRunner
    from stream_rlhf.distributed import RankGroup, RankSpec

    first = next(iter(members.values()))
    _pin(first, rank)
    process = f"{group_name}-{index}" if rank == 0 else f"{group_name}-{index}.rank{rank}"
    if first.trace is not None:
        trace.start(first.trace, f"{group_name}-{index}", f"rank {rank}")
    world = RankGroup.join(RankSpec(rank, first.ranks, init_method, first.device(rank), first.group_timeout_s))
    try:
        log.info("%s: %s in one process on %s%s", process, ", ".join(members), world.device,
                 f" (rank {rank} of {world.world_size} of each)" if world.distributed else "")
        groups = {name: _subgroup(world) for name in members}  # made in the same order on every rank
        order = TurnOrder(_subgroup(world), list(members)) if world.distributed else None
        turns = DeviceTurns(first.last_minibatch, order)
        runs: dict[str, Callable[[], object]] = {}
        stops: dict[str, Callable[[], None]] = {}
        for name, spec in members.items():
            instance_id = f"{name}-{index}"
            stage = import_dotted(spec.cls, "cls")(**spec.kwargs)
            step_context, setup_context = _contexts(turns, name)
            if rank == 0:
                runner = StageRunner(stage, name, instance_id, address, key_dir, prefetch=spec.prefetch,
                                     shm_prefix=prefix, group=groups[name], step_context=step_context,
                                     setup_context=setup_context)
                runs[name], stops[name] = runner.run, runner.request_stop
            else:
                transport = ShmTransport(prefix=prefix, serve=False, key_dir=key_dir)
                runs[name] = GroupFollower(stage, name, instance_id, groups[name], transport, step_context,
                                           setup_context).run
            turns.add(name, stage, spec.offload, _offload_counts(spec, name, instance_id, rank))
        try:
            _run_together(process, runs, stops)
        finally:
            if order is not None:
                order.close()
    finally:
        world.close()


def _subgroup(world: RankGroup) -> RankGroup:
    """A process group of every rank of `world` of its own (a single rank: none), so that one
    member's collectives never queue behind another's."""
    import torch.distributed as dist

    from stream_rlhf.distributed import RankGroup

    if not world.distributed:
        return RankGroup.single(world.device)
    return RankGroup(world.rank, world.world_size, world.device, dist.new_group())


def _run_together(process: str, runs: dict[str, Callable[[], object]], stops: dict[str, Callable[[], None]]) -> None:
    """Each member's `run` on a thread of its own. `stops` (rank 0's broker clients): SIGTERM
    calls them all, draining (a second stops them now), when this is the main thread (under Ray,
    where a worker may run its actor's calls on another, the broker's shutdown drains them); a
    failed member stops the others at once. The other ranks' members stop when their leaders do
    (or fail with them). The threads are daemons: a member left waiting in a collective does not
    keep a failed process alive."""
    errors: dict[str, BaseException] = {}
    done = threading.Event()

    def run(name: str) -> None:
        try:
            runs[name]()
        except BaseException as exc:  # noqa: BLE001 - re-raised by the main thread, named
            errors[name] = exc
        finally:
            done.set()

    if stops and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda *_: [stop() for stop in stops.values()])
    threads = [threading.Thread(target=run, args=(name,), name=f"{name}-stage", daemon=True) for name in runs]
    for thread in threads:
        thread.start()
    while any(thread.is_alive() for thread in threads):
        done.wait(0.5)
        done.clear()
        if errors:
            for name, stop in stops.items():
                if name not in errors:
                    stop()  # drain,
                    stop()  # and stop now: the process fails anyway
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
    """This process's cores and torch threads, from the spec; the worker processes it starts run on
    the cores it had before (`worker_process.HELPER_CORES`)."""
    cores = spec.cores_of(rank)
    if cores is not None:
        os.environ[HELPER_CORES] = ",".join(str(core) for core in sorted(os.sched_getaffinity(0)))
        os.sched_setaffinity(0, cores)
    if spec.threads is not None:
        import torch

        torch.set_num_threads(spec.threads)
