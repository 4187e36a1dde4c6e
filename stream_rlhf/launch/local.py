"""Local launcher: the broker and one process per stage instance on this machine, supervised.

    job = LocalJob(topology, broker_config, {"rollout": StageSpec("pkg.mod:Rollout", instances=2)})
    job.start()
    job.wait(timeout_s=300)   # raises StageFailed naming the instance if one crashes
    job.stop()

A stage of `ranks` > 1 runs each instance as that many processes, one torch.distributed group
(`distributed.py`): rank 0 is the broker client, the others follow it. A rank that dies fails
the job, or restarts its whole group when the stage has restarts left. The stages of a device group
(`device_groups`, one instance each) share one process per rank, named after the group
(`launch/rank.py` run_device_group); it restarts as a whole when every member may restart.

Processes are forked from a server that imported torch once (`process_start.py`: they share its
pages, ~90 MB of PSS each instead of ~310), never from the launcher (no forked sockets or
threads). A crashed stage prints its own traceback; the launcher names it and stops the rest
cleanly. Ctrl-C drains every stage, then stops the broker, which unlinks what shared memory is left.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import queue
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

from stream_rlhf.broker.control.topology import BrokerConfig, Topology
from stream_rlhf.config import ConfigError
from stream_rlhf.launch.launcher import BrokerClient, Watch, stop_grace_s
from stream_rlhf.launch.process_start import FORK_SERVER, fork_server_pid, in_child, launcher_state, start_context
from stream_rlhf.launch.rank import run_device_group, run_stage
from stream_rlhf.launch.spec import StageFailed, StageSpec, take_restart
from stream_rlhf.telemetry import trace

log = logging.getLogger(__name__)


def _broker_main(
    topology: Topology, config: BrokerConfig, address_queue: mp.Queue, admission: Any, cores: list[int] | None = None,
    trace_folder: str | None = None,
) -> None:
    if cores is not None:
        os.sched_setaffinity(0, cores)
    if trace_folder is not None:
        trace.start(trace_folder, "broker", "broker")
    from stream_rlhf.broker.control.server import BrokerServer

    server = BrokerServer(topology, config, admission)
    address_queue.put(server.address)
    server.serve()


def _stage_main(stage_name: str, instance_id: str, spec: StageSpec, address: str, key_dir: str | None, prefix: str,
                rank: int = 0, init_method: str | None = None) -> None:
    run_stage(stage_name, instance_id, spec, address, key_dir, prefix, rank, init_method)
    _exit_cleanly()


def _device_group_main(group: str, index: int, members: dict[str, StageSpec], address: str, key_dir: str | None,
                       prefix: str, rank: int = 0, init_method: str | None = None) -> None:
    run_device_group(group, index, members, address, key_dir, prefix, rank, init_method)
    _exit_cleanly()


def _exit_cleanly() -> None:
    """The process's stages stopped cleanly: skip interpreter teardown, which takes seconds per
    process once torch and transformers are loaded (a crash before this exits with its traceback)."""
    trace.stop()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class LocalJob(BrokerClient):
    def __init__(
        self,
        topology: Topology,
        broker: BrokerConfig,
        stages: dict[str, StageSpec],
        admission: Any = None,
        broker_cores: list[int] | None = None,
        trace_folder: str | None = None,
        device_groups: dict[str, list[str]] | None = None,
    ):
        """`trace_folder`: where the broker appends its trace events (queue depths); each stage
        rank traces to its spec's `trace` folder. `device_groups`: group name -> stages run in one
        process per rank (one instance each, the same ranks)."""
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
        self._ctx = start_context()
        self.broker_process: mp.Process | None = None
        self.processes: dict[str, mp.Process] = {}
        """By process name: the instance id for rank 0, `<instance id>.rank<r>` for the others."""
        self.device_groups = dict(device_groups or {})
        for group, members in self.device_groups.items():
            several = [m for m in members if stages[m].instances != 1]
            if several:
                raise ConfigError(f"device_groups.{group}: {several} run several instances; members run one")
            if len({stages[m].ranks for m in members}) > 1:
                raise ConfigError(f"device_groups.{group}: its members run one process per rank, so the same ranks: "
                                  + ", ".join(f"{m}={stages[m].ranks}" for m in members))
        self.restarts_left = {name: spec.restarts for name, spec in stages.items()}
        self.restarts_left.update({group: min(stages[m].restarts for m in members)
                                   for group, members in self.device_groups.items()})
        self.failed: list[str] = []
        """The processes whose failure stopped the job ("broker" for the broker), once `wait` raised."""
        self._rendezvous: str | None = None  # folder of the rank groups' init files
        self._group_starts = 0

    def pids(self) -> dict[str, int]:
        """The process ids of the broker ("broker"), of every rank process by name, as started (one
        that has exited may still be listed; a restarted one has its new id), and of the fork server
        they share pages with ("fork_server", `process_start.py`). Safe to call from another
        thread: `telemetry/memory.py` samples the job's memory with it."""
        named = {"broker": self.broker_process, **self.processes}
        pids = {name: p.pid for name, p in named.items() if p is not None and p.pid is not None}
        server = fork_server_pid()
        return pids | ({FORK_SERVER: server} if server is not None else {})

    @property
    def key_dir(self) -> str | None:
        return self.broker.curve.key_dir if self.broker.curve else None

    def start(self, timeout_s: float = 30.0) -> str:
        self.start_broker(timeout_s)
        grouped = {m for members in self.device_groups.values() for m in members}
        for stage_name, spec in self.stages.items():
            for index in range(spec.instances if stage_name not in grouped else 0):
                self.start_instance(stage_name, index)
        for group in self.device_groups:
            self.start_device_group(group)
        return self.address

    def start_broker(self, timeout_s: float = 30.0) -> str:
        """Start (or, after a crash, restart) the broker; a restarted one replays its journal and
        the stages reconnect to it by themselves when the address is fixed."""
        address_queue = self._ctx.Queue()
        self.broker_process = self._ctx.Process(
            target=in_child, args=(launcher_state(), _broker_main, self.topology, self.broker, address_queue,
                                   self.admission, self.broker_cores, self.trace_folder),
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
        init_method = self._new_rendezvous(instance_id, spec.ranks)
        for rank in range(spec.ranks):
            name = rank_process_name(instance_id, rank)
            process = self._ctx.Process(
                target=in_child,
                args=(launcher_state(), _stage_main, stage_name, instance_id, spec, self.address, self.key_dir,
                      self.broker.shm_prefix, rank, init_method),
                name=name,
            )
            process.start()
            self.processes[name] = process
        return self.processes[instance_id]

    def _new_rendezvous(self, instance_id: str, ranks: int) -> str | None:
        """A fresh rendezvous for a group of `ranks` processes (None for one)."""
        if ranks == 1:
            return None
        self._rendezvous = self._rendezvous or tempfile.mkdtemp(prefix="srlhf-groups-")
        self._group_starts += 1
        return "file://" + os.path.join(self._rendezvous, f"{instance_id}-{self._group_starts}")

    def start_device_group(self, group: str) -> mp.Process:
        """Start the processes of device group `group`, one per rank (instance 0 of each of its
        stages); returns rank 0's."""
        members = {m: self.stages[m] for m in self.device_groups[group]}
        ranks = next(iter(members.values())).ranks
        init_method = self._new_rendezvous(f"{group}-0", ranks)
        for rank in range(ranks):
            name = rank_process_name(f"{group}-0", rank)
            process = self._ctx.Process(
                target=in_child,
                args=(launcher_state(), _device_group_main, group, 0, members, self.address, self.key_dir,
                      self.broker.shm_prefix, rank, init_method),
                name=name,
            )
            process.start()
            self.processes[name] = process
        return self.processes[f"{group}-0"]

    def wait(self, timeout_s: float, watch: Callable[[], None] | None = None, watch_every_s: float = 2.0) -> None:
        """Until every stage process has exited; a failed one, or the broker failing under them,
        stops the job and raises. `watch` is called every `watch_every_s` and fails the job by
        raising StageFailed (e.g. `fail_on_dropped_handles`). A broker that exits with code 0 has
        stopped cleanly once every instance left (their processes may still be closing)."""
        deadline = time.monotonic() + timeout_s
        watching = Watch(watch, watch_every_s, self.stop)
        while any(p.is_alive() for p in self.processes.values()):
            code = self.broker_process.exitcode if self.broker_process is not None else None
            if code not in (None, 0):
                self.failed = ["broker"]
                self.stop()
                raise StageFailed(f"the broker exited (code {code}) while {len(self.processes)} stage process(es) "
                                  "ran; its log is above")
            watching.poll()
            failed = [name for name, p in self.processes.items() if p.exitcode not in (None, 0)]
            # a rank killed by a signal first: the others of its group failed because it died
            failed.sort(key=lambda name: self.processes[name].exitcode >= 0)
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
        if stage_name in self.device_groups:
            return self._restart_device_group(stage_name)
        spec = self.stages[stage_name]
        backoff_s = take_restart(self.restarts_left, stage_name, spec)
        if backoff_s is None:
            return False
        log.warning("%s exited with %s: restarting it%s in %.1fs (%d restart(s) left for %s)", process_name,
                    self.processes[process_name].exitcode,
                    f" with every rank of {instance_id}" if spec.ranks > 1 else "",
                    backoff_s, self.restarts_left[stage_name], stage_name)
        for rank in range(spec.ranks):  # the survivors of a group wait on the dead rank
            _end(self.processes.pop(rank_process_name(instance_id, rank)), grace_s=5.0)
        time.sleep(backoff_s)
        self.start_instance(stage_name, int(index))
        return True

    def _restart_device_group(self, group: str) -> bool:
        if self.restarts_left[group] <= 0:
            return False
        self.restarts_left[group] -= 1
        names = [name for name in self.processes if name.partition(".rank")[0] == f"{group}-0"]
        codes = ", ".join(f"{name} {self.processes[name].exitcode}" for name in names)
        log.warning("%s (%s) exited (%s): restarting it (%d restart(s) left)", f"{group}-0",
                    ", ".join(self.device_groups[group]), codes, self.restarts_left[group])
        for name in names:  # the survivors of a group of ranks wait on the dead one
            _end(self.processes.pop(name), grace_s=5.0)
        self.start_device_group(group)
        return True

    def stop(self, grace_s: float | None = None) -> None:
        """Drain every stage, then stop the broker; kill only what ignores that for `grace_s`
        (None: `launcher.stop_grace_s`). Without a broker no stage can drain: each is terminated
        at once."""
        if self.broker_process is None:
            return
        grace_s = stop_grace_s(self.broker) if grace_s is None else grace_s
        broker_alive = self.broker_process.is_alive()
        if broker_alive and any(p.is_alive() for p in self.processes.values()):
            self.ask_shutdown()
        deadline = time.monotonic() + (grace_s if broker_alive else 0.0)
        for process in self.processes.values():
            process.join(max(0.1, deadline - time.monotonic()))
            if process.is_alive():
                log.warning("%s ignored shutdown: terminating" if broker_alive else
                            "%s cannot drain without the broker: terminating", process.name)
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
