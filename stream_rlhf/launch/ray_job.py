"""Ray launcher (`launcher: ray`): the job plan's broker and ranks as Ray actors in one placement group.

    job = RayJob(plan)        # plan.ray: the cluster's address (None: a local instance), the strategy
    job.start()               # ray.init, a placement group of one bundle per process, the broker, the ranks
    job.wait(timeout_s)       # StageFailed naming a failed rank, with its traceback
    job.stop()                # drain through the broker, kill what is left, remove the group

Each bundle holds one process's share of the CPUs (`RankPlan.cpus`), its GPU, and the custom
resources `ray.stage_resources` names for its stage, so stages land on the nodes that offer them.
The actor of a rank runs it in its own worker process (`launch/rank.py`), exactly as a local
process would, except that Ray's resources replace core pinning and core lending, and a rank on a
GPU uses the one Ray assigned it (`CUDA_VISIBLE_DEVICES`: cuda:0). A group of several ranks meets
at a TCP rendezvous on its leader's node. A device group (`placement.device_groups`) is one actor in
one bundle per rank, as it is one process per rank under the local launcher: it runs that rank of
every member (`launch/rank.py` run_device_group), restarts as a whole (when every member has
restarts left) and counts as each of its members wherever the plan asks which host a stage is on.

Across hosts (`JobPlan.spans_hosts`: a cluster, or `ray.node_hosts`) the broker binds its node's
address, and it and every rank get the plan's CURVE keys in their arguments (each writes them to a
private folder of its own; a plan across hosts without keys is refused before anything starts).
Each rank's host id (`STREAM_RLHF_HOST_ID`) is its machine's, or with `ray.node_hosts` its node's:
a consumer on another host than its producer fetches the payload from the producer's payload
server over TCP, and rollout and the critic forward get their weights by broadcast groups
(`driver/plan.py`), which meet through an address book the broker's actor serves on its node
(`weights/address_book.py`, handed to every rank). A rank on another host than the driver's
writes into a run folder and a weight root of its host, shipped into the driver's run folder
while it runs and in full at the end (`ray_hosts.py`). Stages that still meet through one host's
/dev/shm weight store (`JobPlan.same_host`) must share a host: a placement that splits them fails
the job at start, naming the pair. Ray itself is imported only by the launcher (this module,
`ray_actors.py`, `ray_hosts.py`: the `ray` extra).
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from stream_rlhf.broker.payload.shm import host_id, sweep_when_gone
from stream_rlhf.broker.sockets import CurveKeys
from stream_rlhf.config import ConfigError
from stream_rlhf.launch.launcher import BrokerClient, Watch, stop_grace_s
from stream_rlhf.launch.plan import BROKER, JobPlan, RankPlan
from stream_rlhf.launch.ray_actors import BrokerActor, RankActor
from stream_rlhf.launch.ray_hosts import RayHosts
from stream_rlhf.launch.spec import StageFailed, StageSpec, take_restart

log = logging.getLogger(__name__)


class RayJob(BrokerClient):
    def __init__(self, plan: JobPlan):
        try:
            import ray  # noqa: F401
        except ImportError:
            raise ConfigError("launcher=ray: Ray is not installed (pip install -e '.[ray]')") from None
        if plan.spans_hosts and plan.keys is None:
            raise ConfigError(f"job {plan.name}: its plan spans hosts (ray.address={plan.ray.address!r}, "
                              f"ray.node_hosts={plan.ray.node_hosts}) but carries no CURVE keys: the broker and "
                              "the payload servers would take any client (compile it with driver/plan.py's "
                              "compile_plan, which makes them)")
        self.plan = plan
        curve = plan.flow.broker.curve
        self.keys = plan.keys or (CurveKeys.read(curve.key_dir) if curve else None)
        """What the broker and every rank get in their arguments (None: plaintext on loopback)."""
        self.key_dir: str | None = None
        """The driver's own copy of the keys, for its control clients (while the job runs)."""
        self.address = ""
        self.failed: list[str] = []
        self.processes: dict[str, Any] = {}
        """Rank actors by process name (the instance id for rank 0, `<id>.rank<r>` after)."""
        self.placed: dict[str, dict[str, Any]] = {}
        """Where each process ran: Ray node id, node IP, pid, GPU ids (the broker too)."""
        self.restarts_left = {name: spec.restarts for name, spec in plan.flow.stages.items()}
        self.restarts_left.update({group: self._restart_spec(group).restarts for group in plan.flow.device_groups})
        self._bundles = {r.name: (i, r) for i, r in enumerate(plan.ranks())}
        self._runs: dict[Any, str] = {}  # the `run` call of each rank -> its process name
        self._broker: Any = None
        self._broker_run: Any = None
        self._group: Any = None
        self._started_ray = False
        self._cwd = os.getcwd()
        self.hosts = RayHosts(plan, host_id())
        """The run folders of the hosts other than the driver's, shipped into the driver's."""
        self.book: str | None = None
        """The weight-sync groups' address book (a plan across hosts), served by the broker's actor."""

    def start(self, timeout_s: float = 30.0) -> str:
        import ray
        from ray.util.placement_group import placement_group

        settings = self.plan.ray
        # ray.init installs SIGTERM (and SIGINT) handlers that exit the driver at once; the
        # launcher's own (drain, then stop) come back after it
        handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
        if not ray.is_initialized():
            if settings.address is None:  # "local": a new instance, never a cluster found on this machine
                ray.init(address="local", num_cpus=settings.num_cpus, include_dashboard=False)
                self._started_ray = True
            else:
                try:
                    ray.init(address=settings.address)
                except (ConnectionError, ValueError, RuntimeError) as exc:
                    raise ConfigError(f"ray.address={settings.address!r}: "
                                      f"cannot join that Ray cluster: {exc}") from None
        if threading.current_thread() is threading.main_thread():
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
        if self.keys is not None:
            self.key_dir = str(self.keys.write(tempfile.mkdtemp(prefix="srlhf-keys-")))
        ranks = [rank for _, rank in sorted(self._bundles.values(), key=lambda item: item[0])]
        bundles = [_bundle(r) for r in ranks]
        self._group = placement_group(bundles, strategy=settings.strategy, name=f"stream-rlhf-{self.plan.name}")
        ready, _ = ray.wait([self._group.ready()], timeout=settings.start_timeout_s)
        if not ready:
            raise StageFailed(f"Ray could not place the job's {len(bundles)} bundles within ray.start_timeout_s="
                              f"{settings.start_timeout_s:g} (strategy {settings.strategy}); asked for "
                              f"{_summed(bundles)}, the cluster has {ray.cluster_resources()}")
        index, broker = self._bundles[BROKER]
        self._broker = self._actor(BrokerActor, index, broker, max_concurrency=2)
        wait_s = max(timeout_s, settings.start_timeout_s)  # a loaded node starts a worker process slowly
        try:
            where = self.placed[BROKER] = self._host_of(ray.get(self._broker.where.remote(), timeout=wait_s))
            trace_folder = self.hosts.trace_folder(self.plan.flow.trace_folder, where["node"], where["host_id"])
            self.address, self.book = ray.get(self._broker.open.remote(self.plan, self._cwd, where["host_id"],
                                                                       trace_folder), timeout=wait_s)
        except ray.exceptions.GetTimeoutError:
            raise StageFailed(f"the broker's Ray actor did not start and open within {wait_s:g}s "
                              "(ray.start_timeout_s)") from None
        self._broker_run = self._broker.serve.remote()
        _log_placed(BROKER, self.placed[BROKER])
        groups = self.plan.flow.device_groups
        grouped = {member for members in groups.values() for member in members}
        self.start_instances([(stage, index) for stage, spec in self.plan.flow.stages.items() if stage not in grouped
                              for index in range(spec.instances)] + [(group, 0) for group in groups])
        return self.address

    def _actor(self, cls: type, index: int, rank: RankPlan, max_concurrency: int = 1) -> Any:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        strategy = PlacementGroupSchedulingStrategy(self._group, placement_group_bundle_index=index)
        remote = ray.remote(cls).options(num_cpus=rank.cpus, num_gpus=rank.gpus, resources=rank.resources or None,
                                         scheduling_strategy=strategy, max_restarts=0, max_concurrency=max_concurrency)
        return remote.remote()

    def start_instances(self, instances: list[tuple[str, int]]) -> None:
        """Start an actor for every rank of each (stage, index) instance (a device group's one
        process for a (group, 0)), wait until every one is up (Ray starts a few workers at a time),
        then run them all at once, as the local launcher's processes start: a rank that joined the
        broker long after the others would find the job over."""
        import ray

        actors: dict[str, Any] = {}
        for unit, index in instances:
            for name in self._process_names(unit, index):
                actors[name] = self._actor(RankActor, *self._bundles[name])
        self.processes.update(actors)  # from here on, stop() kills them
        self.placed.update(zip(actors, map(self._host_of, ray.get([a.where.remote() for a in actors.values()],
                                                                  timeout=self.plan.ray.start_timeout_s))))
        for name in actors:
            _log_placed(name, self.placed[name])
        self._check_same_host()
        prefix = self.plan.flow.broker.shm_prefix
        pinned = self.plan.ray.own_instance
        for unit, index in instances:
            names = self._process_names(unit, index)
            instance_id = names[0]
            init_method = ray.get(actors[instance_id].rendezvous.remote()) if len(names) > 1 else None
            members = self.plan.flow.device_groups.get(unit)
            for rank, name in enumerate(names):
                where = self.placed[name]
                payloads = self.hosts.payload_server(where["node"], where["host_id"], self.address)
                if members is not None:
                    specs = {m: self.hosts.relocate(m, _under_ray(self.plan.flow.stages[m], pinned), where["node"],
                                                    where["host_id"]) for m in members}
                    run = actors[name].run_group.remote(unit, index, specs, self.address, self.keys, prefix, rank,
                                                        init_method, self._cwd, where["host_id"], self.book, payloads)
                else:
                    spec = self.hosts.relocate(unit, _under_ray(self.plan.flow.stages[unit], pinned), where["node"],
                                               where["host_id"])
                    run = actors[name].run.remote(unit, instance_id, spec, self.address, self.keys, prefix, rank,
                                                  init_method, self._cwd, where["host_id"], self.book, payloads)
                self._runs[run] = name

    def _process_names(self, unit: str, index: int) -> list[str]:
        """The processes of instance `index` of a stage or a device group: one per rank (a group's
        members have the same ranks)."""
        instance_id = f"{unit}-{index}"
        ranks = self.plan.flow.stages[self.plan.flow.device_groups.get(unit, [unit])[0]].ranks
        return [instance_id if r == 0 else f"{instance_id}.rank{r}" for r in range(ranks)]

    def _restart_spec(self, unit: str) -> StageSpec:
        """The spec whose `restarts` a stage or device group gets: a group's member with the fewest
        (a group restarts as a whole, so only while every member may)."""
        members = self.plan.flow.device_groups.get(unit, [unit])
        return min((self.plan.flow.stages[m] for m in members), key=lambda spec: spec.restarts)

    def _check_same_host(self) -> None:
        """Fail the job naming two stages that must share a host and were placed on two (a device
        group's members are on its process's host)."""
        hosts: dict[str, set[str]] = {}
        for name, where in self.placed.items():
            unit = name.partition(".rank")[0].rpartition("-")[0] or name
            for stage in self.plan.flow.device_groups.get(unit, [unit]):
                hosts.setdefault(stage, set()).add(where["host_id"])
        for first, second, why in self.plan.same_host:
            if first in hosts and second in hosts and len(hosts[first] | hosts[second]) > 1:
                self._fail([first, second], f"{first} (on {', '.join(sorted(hosts[first]))}) and {second} (on "
                           f"{', '.join(sorted(hosts[second]))}) must share a host: {why}; pin them to the same "
                           "nodes with ray.stage_resources")

    def wait(self, timeout_s: float, watch: Callable[[], None] | None = None, watch_every_s: float = 2.0) -> None:
        """Until every rank's `run` returned; a failed one (an exception, or its worker died) stops
        the job and raises StageFailed naming it, unless its stage has restarts left."""
        import ray

        deadline = time.monotonic() + timeout_s
        watching = Watch(watch, watch_every_s, self.stop)
        while self._runs:
            done, _ = ray.wait([self._broker_run], timeout=0)
            broker_error = _error(self._broker_run) if done else ""
            if broker_error:  # a broker that returned has stopped cleanly: its ranks are leaving
                self._fail(["broker"], f"the broker failed while {len(self._runs)} rank(s) ran: {broker_error}")
            watching.poll()
            self.hosts.poll()
            done, _ = ray.wait(list(self._runs), num_returns=1, timeout=0.2)
            for ref in done:
                name = self._runs.pop(ref)
                error = _error(ref)
                if error and not self._restart(name, error):
                    self._fail([name], f"stage instance(s) failed: {name}: {error}")
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"job did not finish in {timeout_s}s")

    def _fail(self, names: list[str], message: str) -> None:
        self.failed = names
        self.stop()
        raise StageFailed(message)

    def _restart(self, name: str, error: str) -> bool:
        """Start the crashed rank's instance again (every rank; a device group's process with all its
        members) if its stage (every member) has restarts left."""
        import ray

        instance_id = name.partition(".rank")[0]
        stage, _, index = instance_id.rpartition("-")
        backoff_s = take_restart(self.restarts_left, stage, self._restart_spec(stage))
        if backoff_s is None:
            return False
        log.warning("%s failed (%s): restarting it in %.1fs (%d restart(s) left for %s)", name,
                    error.splitlines()[0] if error else "", backoff_s, self.restarts_left[stage], stage)
        for other in [n for n in self.processes if n.partition(".rank")[0] == instance_id]:
            ray.kill(self.processes.pop(other))
            self._runs = {ref: n for ref, n in self._runs.items() if n != other}
        time.sleep(backoff_s)
        self.start_instances([(stage, int(index))])
        return True

    def stop(self, grace_s: float | None = None) -> None:
        """Drain every rank through the broker, stop the broker, kill what is left of either (after
        `grace_s`; None: `launcher.stop_grace_s`; at once when the broker is gone), remove the
        shared-memory segments of the killed ranks on every host, the placement group and (when the
        job started it) the local Ray instance."""
        import ray
        from ray.util.placement_group import remove_placement_group

        if not ray.is_initialized():
            return
        grace_s = stop_grace_s(self.plan.flow.broker) if grace_s is None else grace_s
        running: set[str] = set()
        # without a broker no rank can drain: each is killed at once
        broker_gone = self._broker_run is not None and bool(ray.wait([self._broker_run], timeout=0)[0])
        if self._runs and self.address:
            if not broker_gone:
                self.ask_shutdown()
            _, pending = ray.wait(list(self._runs), num_returns=len(self._runs), timeout=0 if broker_gone else grace_s)
            running = {self._runs[ref] for ref in pending}
        for name in running:
            log.warning("%s cannot drain without the broker: killing its actor" if broker_gone else
                        "%s ignored shutdown: killing its actor", name)
        killed = list(self.processes.values())
        self._runs.clear()
        self.processes.clear()
        if self._broker is not None:
            try:
                ray.get(self._broker.request_stop.remote(), timeout=5)
                ray.wait([self._broker_run], timeout=grace_s)
            except Exception as exc:  # noqa: BLE001 - a dead broker actor is killed below
                log.warning("the broker did not stop cleanly: %s", exc)
            killed.append(self._broker)
            self._broker = None
        for actor in killed:
            ray.kill(actor)
        # a call on a killed actor fails once Ray has it dead: then no actor outlives the job
        probes = [actor.where.remote() for actor in killed]
        ray.wait(probes, num_returns=len(probes), timeout=10)
        pids: dict[str, list[int]] = {}  # this job's processes by host: a killed one's segments are left behind
        for where in self.placed.values():
            pids.setdefault(where["host_id"], []).append(where["pid"])
        sweep_when_gone(self.plan.flow.broker.shm_prefix, pids.get(self.hosts.driver_host, []))
        self.hosts.close(pids)  # every rank has stopped: the last of their files reach the driver; each host sweeps
        if self._group is not None:
            remove_placement_group(self._group)
            self._group = None
        if self._started_ray:
            ray.shutdown()
            self._started_ray = False
            # a killed rank slow to exit under load (past the wait above) leaves its segments: every
            # worker of the instance is gone or going now
            sweep_when_gone(self.plan.flow.broker.shm_prefix, pids.get(self.hosts.driver_host, []))
        if self.key_dir is not None:
            shutil.rmtree(self.key_dir, ignore_errors=True)
            self.key_dir = None

    def _host_of(self, where: dict[str, Any]) -> dict[str, Any]:
        """`where` with the host id its process runs as: its machine's, or with ray.node_hosts its node's."""
        if not self.plan.ray.node_hosts:
            return where
        return {**where, "host_id": f"{where['host_id']}/node-{where['node'][:12]}"}


def _under_ray(spec: StageSpec, own_machine: bool) -> StageSpec:
    """`spec` as a Ray worker runs it: a GPU rank sees only the GPU Ray gave it (cuda:0); no
    lending, and Ray's resources replace pinning, except on a Ray instance the job started on this
    machine (`own_machine`), whose cores are the plan's: there a rank keeps its cores, as under
    the local launcher (an unpinned PPO job ran 12% slower per iteration than a pinned one)."""
    devices = ["cuda:0" if spec.device(r).startswith("cuda") else spec.device(r) for r in range(spec.ranks)]
    if own_machine:
        return replace(spec, lending=None, devices=devices)
    return replace(spec, cores=None, rank_cores=None, lending=None, devices=devices)


def _log_placed(name: str, where: dict[str, Any]) -> None:
    log.info("ray: %s on node %s (%s, pid %d%s, host %s)", name, where["node"], where["ip"], where["pid"],
             f", GPU {','.join(where['gpus'])}" if where["gpus"] else "", where["host_id"])


def _bundle(rank: RankPlan) -> dict[str, float]:
    return {"CPU": rank.cpus, **({"GPU": rank.gpus} if rank.gpus else {}), **rank.resources}


def _summed(bundles: list[dict[str, float]]) -> dict[str, float]:
    total: dict[str, float] = {}
    for bundle in bundles:
        for key, amount in bundle.items():
            total[key] = round(total.get(key, 0.0) + amount, 4)
    return total


def _error(ref: Any) -> str:
    """'' when the call returned; else what went wrong, with the remote traceback."""
    import ray

    try:
        ray.get(ref)
        return ""
    except ray.exceptions.RayTaskError as exc:
        return str(exc)
    except ray.exceptions.RayActorError as exc:
        return f"its Ray worker died ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
