"""Local launcher: the broker and one process per stage instance on this machine, supervised.

    job = LocalJob(topology, broker_config, {"rollout": StageSpec("pkg.mod:Rollout", instances=2)})
    job.start()
    job.wait(timeout_s=300)   # raises StageFailed naming the instance if one crashes
    job.stop()

A stage of `ranks` > 1 runs each instance as that many processes, one torch.distributed group
(`broker/rank_group.py`): rank 0 is the broker client, the others follow it. A rank that dies fails
the job, or restarts its whole group when the stage has restarts left.

Processes are started with `spawn` (no forked sockets or threads). A crashed stage prints its own
traceback; the launcher names it and stops the rest cleanly. Ctrl-C drains every stage, then stops
the broker, which unlinks what shared memory is left.
"""

from __future__ import annotations

import ctypes
import importlib
import logging
import multiprocessing as mp
import os
import queue
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

from stream_rlhf.broker.client import ControlClient
from stream_rlhf.broker.topology import BrokerConfig, Topology
from stream_rlhf.config import ConfigError
from stream_rlhf.launch.core_board import CoreLending
from stream_rlhf.telemetry import trace

log = logging.getLogger(__name__)
RESTART_BACKOFF_S = 0.5
"""The wait before a crashed instance's first restart; it doubles with each further restart."""
PR_SET_PDEATHSIG = 1  # linux/prctl.h


@dataclass(frozen=True)
class StageSpec:
    cls: str
    """Stage class as "package.module:ClassName"."""
    instances: int = 1
    """Data-parallel instances; the broker hands each handle to the least-loaded one."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the class."""
    prefetch: int = 2
    """Handles delivered to an instance ahead of the one it is processing."""
    cores: list[int] | None = None
    """CPU cores the process is pinned to (os.sched_setaffinity); None: all."""
    threads: int | None = None
    """torch intra-op threads; None: torch's default."""
    restarts: int = 0
    """How often the launcher restarts a crashed instance before failing the job."""
    trace: str | None = None
    """Folder where each rank appends its trace events (`telemetry/trace.py`); None: no trace."""
    ranks: int = 1
    """Processes per instance, one torch.distributed group (gloo on CPU, NCCL on CUDA)."""
    devices: list[str] | None = None
    """The torch device of each rank (`cpu`, `cuda:N`); None: `cpu` for every rank."""
    rank_cores: list[list[int]] | None = None
    """The cores of each rank (with `threads` torch threads each); None: `cores` for every rank."""
    group_timeout_s: float = 3600.0
    """How long a rank waits in a collective (a follower waits this long for its leader's next handle)."""
    lending: CoreLending | None = None
    """Borrow the other side's cores while it is idle (`core_lending.py`; one-rank instances)."""

    def __post_init__(self) -> None:
        if ":" not in self.cls:
            raise ConfigError(f"cls={self.cls!r}: expected 'package.module:ClassName'")
        if self.instances < 1:
            raise ConfigError(f"instances={self.instances}: must be >= 1")
        if self.prefetch < 1:
            raise ConfigError(f"prefetch={self.prefetch}: must be >= 1")
        if self.threads is not None and self.threads < 1:
            raise ConfigError(f"threads={self.threads}: must be >= 1")
        if self.restarts < 0:
            raise ConfigError(f"restarts={self.restarts}: must be >= 0")
        if self.ranks < 1:
            raise ConfigError(f"ranks={self.ranks}: must be >= 1")
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


def load_class(path: str) -> type:
    module_name, _, name = path.partition(":")
    try:
        return getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"cls={path!r}: cannot load: {exc}") from None


def setup_logging(level: int = logging.INFO) -> None:
    logging.basicConfig(level=level, format="%(asctime)s %(processName)s %(levelname)s %(message)s")


def child_signals() -> None:
    """For a child process (the broker, a stage, a rollout's vLLM engine): Ctrl-C reaches the
    whole process group; the parent alone handles it and stops its children (the launcher
    through the broker and SIGTERM), so a child never dies half-started. If the parent itself
    dies (even by SIGKILL), Linux sends the child SIGTERM: no orphans."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _broker_main(
    topology: Topology, config: BrokerConfig, address_queue: mp.Queue, admission: Any, cores: list[int] | None = None,
    trace_folder: str | None = None,
) -> None:
    child_signals()
    setup_logging()
    if cores is not None:
        os.sched_setaffinity(0, cores)
    if trace_folder is not None:
        trace.start(trace_folder, "broker", "broker")
    from stream_rlhf.broker.server import BrokerServer

    server = BrokerServer(topology, config, admission)
    address_queue.put(server.address)
    server.serve()


def _stage_main(stage_name: str, instance_id: str, spec: StageSpec, address: str, key_dir: str | None, prefix: str,
                rank: int = 0, init_method: str | None = None) -> None:
    child_signals()
    setup_logging()
    run_stage(stage_name, instance_id, spec, address, key_dir, prefix, rank, init_method)
    trace.stop()
    # the instance has stopped cleanly; skip interpreter teardown, which takes seconds per
    # process once torch and transformers are loaded (a crash above still exits with its traceback)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


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


class LocalJob:
    def __init__(
        self,
        topology: Topology,
        broker: BrokerConfig,
        stages: dict[str, StageSpec],
        admission: Any = None,
        broker_cores: list[int] | None = None,
        trace_folder: str | None = None,
    ):
        """`trace_folder`: where the broker appends its trace events (queue depths); each stage
        rank traces to its spec's `trace` folder."""
        missing = topology.stages() - set(stages)
        if missing:
            raise ConfigError(f"stages: no spec for {sorted(missing)} (they appear in topics)")
        unused = set(stages) - topology.stages()
        if unused:
            raise ConfigError(f"stages: {sorted(unused)} appear in no topic")
        self.topology = topology
        self.broker = broker
        self.stages = stages
        self.admission = admission
        self.broker_cores = broker_cores
        self.trace_folder = trace_folder
        self.address = ""
        self._ctx = mp.get_context("spawn")
        self.broker_process: mp.Process | None = None
        self.processes: dict[str, mp.Process] = {}
        """By process name: the instance id for rank 0, `<instance id>.rank<r>` for the others."""
        self.restarts_left = {name: spec.restarts for name, spec in stages.items()}
        self.failed: list[str] = []
        """The processes whose failure stopped the job ("broker" for the broker), once `wait` raised."""
        self._rendezvous: str | None = None  # folder of the rank groups' init files
        self._group_starts = 0

    @property
    def key_dir(self) -> str | None:
        return self.broker.curve.key_dir if self.broker.curve else None

    def start(self, timeout_s: float = 30.0) -> str:
        self.start_broker(timeout_s)
        for stage_name, spec in self.stages.items():
            for index in range(spec.instances):
                self.start_instance(stage_name, index)
        return self.address

    def start_broker(self, timeout_s: float = 30.0) -> str:
        """Start (or, after a crash, restart) the broker; a restarted one replays its journal and
        the stages reconnect to it by themselves when the address is fixed."""
        address_queue = self._ctx.Queue()
        self.broker_process = self._ctx.Process(
            target=_broker_main, args=(self.topology, self.broker, address_queue, self.admission, self.broker_cores,
                  self.trace_folder),
            name="broker",
        )
        self.broker_process.start()
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self.address = address_queue.get(timeout=0.1)
                return self.address
            except queue.Empty:
                if not self.broker_process.is_alive():
                    raise StageFailed(f"the broker exited (code {self.broker_process.exitcode}) before it was "
                                      f"listening on {self.broker.address}; traceback above") from None
                if time.monotonic() > deadline:
                    raise StageFailed(f"the broker was not listening after {timeout_s}s") from None

    def start_instance(self, stage_name: str, index: int) -> mp.Process:
        """Start every rank of instance `index` of `stage_name`; returns its leader's process."""
        instance_id = f"{stage_name}-{index}"
        spec = self.stages[stage_name]
        init_method = None
        if spec.ranks > 1:
            self._rendezvous = self._rendezvous or tempfile.mkdtemp(prefix="srlhf-groups-")
            self._group_starts += 1
            init_method = "file://" + os.path.join(self._rendezvous, f"{instance_id}-{self._group_starts}")
        for rank in range(spec.ranks):
            name = rank_process_name(instance_id, rank)
            process = self._ctx.Process(
                target=_stage_main,
                args=(stage_name, instance_id, spec, self.address, self.key_dir, self.broker.shm_prefix, rank, init_method),
                name=name,
            )
            process.start()
            self.processes[name] = process
        return self.processes[instance_id]

    def wait(self, timeout_s: float, watch: Callable[[], None] | None = None, watch_every_s: float = 2.0) -> None:
        """Until every stage process has exited; a failed one, or the broker failing under them,
        stops the job and raises. `watch` is called every `watch_every_s` and fails the job by
        raising StageFailed (e.g. `fail_on_dropped_handles`). A broker that exits with code 0 has
        stopped cleanly once every instance left (their processes may still be closing)."""
        deadline = time.monotonic() + timeout_s
        next_watch = time.monotonic() + watch_every_s
        while any(p.is_alive() for p in self.processes.values()):
            code = self.broker_process.exitcode if self.broker_process is not None else None
            if code not in (None, 0):
                self.failed = ["broker"]
                self.stop()
                raise StageFailed(f"the broker exited (code {code}) while {len(self.processes)} stage process(es) "
                                  "ran; its log is above")
            if watch is not None and time.monotonic() >= next_watch:
                next_watch = time.monotonic() + watch_every_s
                try:
                    watch()
                except StageFailed:
                    self.stop()
                    raise
            failed = [name for name, p in self.processes.items() if p.exitcode not in (None, 0)]
            failed = [name for name in failed if not self._restart(name)]
            if failed:
                codes = ", ".join(f"{n} (exit {self.processes[n].exitcode})" for n in failed)
                self.failed = failed
                self.stop()
                raise StageFailed(f"stage instance(s) failed: {codes}; traceback above")
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"job did not finish in {timeout_s}s")
            time.sleep(0.1)
        failed = [name for name, p in self.processes.items() if p.exitcode != 0]
        if failed:
            self.failed = failed
            self.stop()
            raise StageFailed(f"stage instance(s) failed: {failed}; traceback above")

    def _restart(self, process_name: str) -> bool:
        """Restart the instance of a crashed process (all of its ranks) if its stage allows more
        restarts; False when it does not."""
        if self.processes[process_name].exitcode in (None, 0):
            return True  # started again already, with another rank of its group
        instance_id = process_name.partition(".rank")[0]
        stage_name, _, index = instance_id.rpartition("-")
        if self.restarts_left.get(stage_name, 0) <= 0:
            return False
        self.restarts_left[stage_name] -= 1
        spec = self.stages[stage_name]
        backoff_s = RESTART_BACKOFF_S * 2 ** (spec.restarts - self.restarts_left[stage_name] - 1)
        log.warning("%s exited with %s: restarting it%s in %.1fs (%d restart(s) left for %s)", process_name,
                    self.processes[process_name].exitcode, f" with every rank of {instance_id}" if spec.ranks > 1 else "",
                    backoff_s, self.restarts_left[stage_name], stage_name)
        for rank in range(spec.ranks):  # the survivors of a group wait on the dead rank
            _end(self.processes.pop(rank_process_name(instance_id, rank)), grace_s=5.0)
        time.sleep(backoff_s)  # a stage that fails at start-up does not spin through its restarts
        self.start_instance(stage_name, int(index))
        return True

    def client(self) -> ControlClient:
        return ControlClient(self.address, self.key_dir)

    def fail_on_dropped_handles(self) -> None:
        """A `wait` watch for jobs that need every handle (an RL iteration waits for all of its
        mini-batches): StageFailed as soon as the broker has dropped one, instead of a job that
        waits for it until its timeout. A broker that does not answer is left to `wait`."""
        try:
            with ControlClient(self.address, self.key_dir, timeout_s=2.0) as client:
                stats = client.stats()
        except Exception:  # noqa: BLE001 - a dead broker is reported by the process checks
            return
        dropped = int(stats.get("dropped", 0))
        if dropped:
            reasons = ", ".join(f"{k.removeprefix('dropped.')} {int(v)}" for k, v in sorted(stats.items())
                                if k.startswith("dropped."))
            raise StageFailed(f"the broker dropped {dropped} handle(s) ({reasons}; the reasons are in its log above): "
                              "the job cannot complete without them")

    def stop(self, grace_s: float = 15.0) -> None:
        """Drain every stage, then stop the broker; kill only what ignores that."""
        if self.broker_process is None:
            return
        if self.broker_process.is_alive() and any(p.is_alive() for p in self.processes.values()):
            try:
                with ControlClient(self.address, self.key_dir, timeout_s=2.0) as client:
                    client.control("shutdown")
            except Exception as exc:  # the broker may be the thing that died
                log.warning("could not send shutdown through the broker: %s", exc)
        deadline = time.monotonic() + grace_s
        for process in self.processes.values():
            process.join(max(0.1, deadline - time.monotonic()))
            if process.is_alive():
                log.warning("%s ignored shutdown: terminating", process.name)
                _end(process, grace_s=5.0)
        if self.broker_process.is_alive():
            self.broker_process.terminate()  # SIGTERM: the broker's clean stop
            self.broker_process.join(grace_s)
        if self.broker_process.is_alive():
            self.broker_process.kill()
        self.broker_process = None
        if self._rendezvous is not None:
            shutil.rmtree(self._rendezvous, ignore_errors=True)
            self._rendezvous = None


def rank_process_name(instance_id: str, rank: int) -> str:
    return instance_id if rank == 0 else f"{instance_id}.rank{rank}"


def _end(process: mp.Process, grace_s: float) -> None:
    """SIGTERM, then SIGKILL what ignores it for `grace_s`."""
    if process.is_alive():
        process.terminate()
        process.join(grace_s)
    if process.is_alive():
        log.warning("%s ignored SIGTERM: killing it", process.name)
        process.kill()
        process.join(5)
