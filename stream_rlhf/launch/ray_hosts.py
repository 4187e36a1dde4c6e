"""The hosts of a Ray job other than the driver's: a run folder and a weight store of their own on
each, mirrored into the driver's run folder while the job runs.

    hosts = RayHosts(plan, driver_host=host_id())
    spec = hosts.relocate(stage, spec, node_id, host)  # a rank's spec writing into its host's run folder
    endpoint = hosts.payload_server(node_id, host, broker_address)  # its host's, named in its payloads
    hosts.poll()                                       # from the supervision loop: ships what changed
    hosts.close(pids)                                  # a last full copy; each host's folders and stray segments go

A rank (or the broker) on another host than the driver's never writes into the driver's run folder
or reads its /dev/shm: every host gets an actor (`_HostActor`, no CPUs, pinned to the node) that
makes a private run folder and owns it and the host's weight root (`JobPlan.weights_root` with the
host's tag: under `ray.node_hosts` the nodes of one machine do not share it either). The ranks'
specs are moved there (`JobPlan.relocate`: the plan's own function for its stage arguments; the
trace folder and the counts folder here). The driver asks each host for what changed every
`SHIP_EVERY_S` (`run_files.py`: appends for metrics and trace lines, whole files for counts and
checkpoints), and for everything once the ranks stopped, before the driver reads the run folder
(the evaluation of the final checkpoint, train_summary.json, the trace merge).

Checkpoints arrive part by part, each part's manifest last (`run_files.py`), and a trainer's prune
on its host reaches the driver as deletions. Trainers on two hosts each hold only their own part,
so neither host's prune finds a complete checkpoint: the driver prunes its copy as the trainers'
prunes recorded (`resume/store.recorded_store`), and rollout's kept outputs the oldest checkpoint
it keeps covers, whenever checkpoint files arrived.

The other way, once per host and path: before a rank on another host starts, what its stage reads
from the driver's run folder (`JobPlan.host_inputs`: a resumed run's checkpoint part, rollout's kept
outputs, the prompt cursor) is copied into the host's run folder, where the mirror counts it as
sent (nothing of it comes back unless a rank there changes it).

Under a plan across hosts every host of ranks, the driver's included, also gets a payload server
of its own (`broker/payload/host_server.py`, in the host's actor; the driver's, in the driver):
its ranks name it in their payloads instead of a server of each process, so a consumer on
another host still gets what a rank that died had published, and a restarted rollout or forward
does not fail the job.

Each host's clock may differ from the driver's: when its actor starts, the driver measures the
offset over a few round trips (`telemetry/trace_clocks.py`), logs it, and keeps it in the trace
folder's clocks.json with the names of the events files that host's processes wrote, so the trace
merge puts that host's events on the driver's clock.

Why through Ray: the driver already supervises every rank through Ray, a host actor outlives the
restarts of its ranks (a restarted prompt source finds its cursor), and the files are fetched by
the side that needs them, in batches of at most `SHIP_BYTES`, with no new message in the broker's
protocol and no port of its own.
"""

from __future__ import annotations

import logging
import re
import shutil
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from stream_rlhf.broker.payload.host_server import HostPayloadServer
from stream_rlhf.broker.payload.shm import sweep_when_gone
from stream_rlhf.broker.sockets import CurveKeys, interface_towards
from stream_rlhf.config import import_dotted
from stream_rlhf.launch.plan import JobPlan
from stream_rlhf.launch.run_files import FileChange, FolderMirror, apply_changes
from stream_rlhf.launch.spec import StageSpec
from stream_rlhf.resume.store import FOLDER as CHECKPOINTS
from stream_rlhf.resume.store import recorded_store
from stream_rlhf.telemetry import trace
from stream_rlhf.telemetry.trace_clocks import HostClocks, measure_offset

log = logging.getLogger(__name__)

SHIP_EVERY_S = 1.0
"""How often the driver asks every host for what changed in its run folder."""
SHIP_BYTES = 32 << 20
"""The most one host sends per call (large checkpoints take several)."""


class _HostActor:
    """A host's run folder and weight root, what changed in the run folder since the last ask,
    and the host's payload server."""

    def open(self, run_name: str, weights_root: str | None) -> str:
        self.root = tempfile.mkdtemp(prefix="srlhf-host-")
        self.run_dir = str(Path(self.root) / run_name)
        Path(self.run_dir).mkdir()
        self.weights_root = weights_root
        self.mirror = FolderMirror(self.run_dir)
        self.payloads: HostPayloadServer | None = None
        return self.run_dir

    def serve_payloads(self, prefix: str, broker: str, keys: CurveKeys | None) -> str:
        """Start the host's payload server (its keys in the host's folder); its endpoint."""
        key_dir = str(keys.write(Path(self.root) / "keys")) if keys is not None else None
        self.payloads = HostPayloadServer(prefix, interface_towards(broker), key_dir)
        return self.payloads.endpoint

    def changes(self, max_bytes: int) -> list[FileChange]:
        return self.mirror.changes(max_bytes)

    def receive(self, changes: list[FileChange]) -> None:
        """Files of the driver's run folder into this one (what a rank reads at a resume), counted
        as sent: they are not shipped back."""
        apply_changes(self.run_dir, changes)
        for change in changes:
            if change.whole and change.last:
                self.mirror.remember(change.path)

    def clock_ns(self) -> int:
        """This host's trace clock."""
        return trace.now_ns()

    def close(self, shm_prefix: str, pids: list[int]) -> None:
        """Remove the host's folders and, once the job's processes `pids` there have exited, the
        payload segments the killed ones left."""
        if self.payloads is not None:
            self.payloads.stop()
        shutil.rmtree(self.root, ignore_errors=True)
        if self.weights_root is not None:
            shutil.rmtree(self.weights_root, ignore_errors=True)
        sweep_when_gone(shm_prefix, pids)


def host_tag(host: str) -> str:
    """A host id as a file name part."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", host)


class RayHosts:
    """The driver's side: one `_HostActor` per host of the job's ranks other than the driver's."""

    def __init__(self, plan: JobPlan, driver_host: str):
        self.plan = plan
        self.driver_host = driver_host
        self.actors: dict[str, Any] = {}
        self.run_dirs: dict[str, str] = {}
        self.sent_inputs: dict[str, set[str]] = {}
        """Per host: the paths of the driver's run folder copied into its own (`relocate`)."""
        self.weight_roots: dict[str, str | None] = {}
        self.payload_servers: dict[str, str] = {}
        """Per host: its payload server's endpoint (`payload_server`)."""
        self._driver_payloads: HostPayloadServer | None = None
        self._driver_keys: str | None = None
        self.shipped_bytes = 0
        self.clocks = HostClocks(driver_host)
        """Each host's clock offset from the driver's, and its trace events files (the trace merge's)."""
        self._trace_inside = _inside(plan.flow.trace_folder, plan.run_dir)
        self._pending: dict[Any, str] = {}  # a `changes` call in flight -> its host
        self._next = 0.0

    def remote(self, host: str) -> bool:
        """Ranks on `host` write into a run folder of their own (the driver's run folder is elsewhere)."""
        return host != self.driver_host and self.plan.run_dir is not None

    def relocate(self, stage: str, spec: StageSpec, node: str, host: str) -> StageSpec:
        """`stage`'s `spec` writing into `host`'s run folder and weight root (unchanged on the
        driver's host), with what its ranks read from the driver's run folder copied there first."""
        if not self.remote(host):
            return spec
        run_dir = self._open(node, host)
        if self.plan.host_inputs is not None:
            self._send_inputs(host, import_dotted(self.plan.host_inputs, "host_inputs")(stage, spec))
        driver_run = self.plan.run_dir
        spec = replace(spec, trace=_moved(spec.trace, driver_run, run_dir),
                       counts_dir=_moved(spec.counts_dir, driver_run, run_dir))
        if self.plan.relocate is None:
            return spec
        return import_dotted(self.plan.relocate, "relocate")(spec, run_dir, self.weight_roots[host])

    def _send_inputs(self, host: str, paths: list[str]) -> None:
        """`paths` of the driver's run folder that `host` has not had yet, into its run folder."""
        import ray

        paths = [p for p in paths if p not in self.sent_inputs.setdefault(host, set())]
        if not paths:
            return
        started, sent = time.monotonic(), 0
        inputs = FolderMirror(self.plan.run_dir, paths)
        while changes := inputs.changes(SHIP_BYTES):
            ray.get(self.actors[host].receive.remote(changes))
            sent += sum(len(c.data) for c in changes)
        self.sent_inputs[host].update(paths)
        log.info("ray: host %s got %s of the driver's run folder (%d bytes, %.1f s)", host, ", ".join(paths), sent,
                 time.monotonic() - started)

    def payload_server(self, node: str, host: str, broker: str) -> str | None:
        """The endpoint of `host`'s payload server, started at the first ask, which its ranks name
        in their payloads (see the module docstring); None when the plan stays on one host."""
        import ray

        if not self.plan.spans_hosts or (host != self.driver_host and not self.remote(host)):
            return None
        if host not in self.payload_servers:
            prefix = self.plan.flow.broker.shm_prefix
            if host == self.driver_host:
                if self.plan.keys is not None:
                    self._driver_keys = str(self.plan.keys.write(tempfile.mkdtemp(prefix="srlhf-keys-")))
                self._driver_payloads = HostPayloadServer(prefix, interface_towards(broker), self._driver_keys)
                self.payload_servers[host] = self._driver_payloads.endpoint
            else:
                self._open(node, host)
                self.payload_servers[host] = ray.get(
                    self.actors[host].serve_payloads.remote(prefix, broker, self.plan.keys), timeout=60)
            log.info("ray: host %s serves its ranks' payloads to the other hosts at %s", host,
                     self.payload_servers[host])
        return self.payload_servers[host]

    def trace_folder(self, folder: str | None, node: str, host: str) -> str | None:
        """The broker's trace folder on `host`."""
        return _moved(folder, self.plan.run_dir, self._open(node, host)) if self.remote(host) else folder

    def _open(self, node: str, host: str) -> str:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        if host not in self.actors:
            strategy = NodeAffinitySchedulingStrategy(node, soft=False)
            actor = ray.remote(_HostActor).options(num_cpus=0, scheduling_strategy=strategy, max_restarts=0).remote()
            weights = f"{self.plan.weights_root}-{host_tag(host)}" if self.plan.weights_root else None
            self.actors[host] = actor
            self.weight_roots[host] = weights
            self.run_dirs[host] = ray.get(actor.open.remote(Path(self.plan.run_dir).name, weights), timeout=60)
            log.info("ray: host %s writes its run folder at %s, shipped to %s", host, self.run_dirs[host],
                     self.plan.run_dir)
            self.clocks.hosts[host] = offset = measure_offset(lambda: ray.get(actor.clock_ns.remote(), timeout=60))
            log.info("ray: host %s's clock is %s", host, offset.describe())
            self._record_clocks()
        return self.run_dirs[host]

    def poll(self) -> None:
        """Apply the answers that came in, and ask the hosts again every SHIP_EVERY_S."""
        import ray

        if self._pending:
            done, _ = ray.wait(list(self._pending), num_returns=len(self._pending), timeout=0)
            for ref in done:
                self._collect(ref, self._pending.pop(ref), 0)
        if not self._pending and time.monotonic() >= self._next:
            self._next = time.monotonic() + SHIP_EVERY_S
            self._pending = {actor.changes.remote(SHIP_BYTES): host for host, actor in self.actors.items()}

    def _collect(self, ref: Any, host: str, timeout_s: float) -> None:
        """Apply the answer of a `changes` call (the host counts what it holds as sent)."""
        import ray

        try:
            self._apply(host, ray.get(ref, timeout=timeout_s or None))
        except Exception as exc:  # noqa: BLE001 - a dead host's ranks fail the job on their own
            log.warning("ray: could not ship host %s's run folder: %s", host, exc)

    def ship_all(self, timeout_s: float = 300.0) -> None:
        """Everything each host's run folder holds now, into the driver's (the ranks have stopped)."""
        import ray

        for ref, host in self._pending.items():
            self._collect(ref, host, timeout_s)
        self._pending.clear()
        deadline = time.monotonic() + timeout_s
        for host, actor in self.actors.items():
            try:
                while time.monotonic() < deadline and self._apply(host, ray.get(actor.changes.remote(SHIP_BYTES),
                                                                                timeout=timeout_s)):
                    pass
            except Exception as exc:  # noqa: BLE001 - what reached the driver stays; the rest is lost
                log.warning("ray: host %s's run folder was not all shipped: %s", host, exc)

    def _apply(self, host: str, changes: list[FileChange]) -> bool:
        self.shipped_bytes += apply_changes(self.plan.run_dir, changes)
        if any(c.path.startswith(f"{CHECKPOINTS}/") for c in changes):
            self._prune_checkpoints()
        files = self.clocks.files.setdefault(host, set())
        named = {Path(c.path).name for c in changes if not c.deleted and c.path.endswith(".jsonl")
                 and Path(c.path).parent == self._trace_inside}
        if not named <= files:
            files |= named
            self._record_clocks()
        return bool(changes)

    def _prune_checkpoints(self) -> None:
        """The driver's copy of the checkpoints keeps what the trainers keep (see the module docstring)."""
        from stream_rlhf.stages.generated_store import prune_checkpoints

        recorded = recorded_store(Path(self.plan.run_dir) / CHECKPOINTS)
        if recorded is not None:
            prune_checkpoints(*recorded, Path(self.plan.run_dir))

    def _record_clocks(self) -> None:
        """clocks.json in the driver's trace folder (none without a trace)."""
        if self.plan.flow.trace_folder is not None:
            self.clocks.write(Path(self.plan.flow.trace_folder))

    def close(self, pids: dict[str, list[int]]) -> None:
        """A last full copy; then every host removes its folders and the segments the job's
        processes there (`pids`: by host) left, and its actor goes."""
        import ray

        if self._driver_payloads is not None:
            self._driver_payloads.stop()
            self._driver_payloads = None
        if self._driver_keys is not None:
            shutil.rmtree(self._driver_keys, ignore_errors=True)
            self._driver_keys = None
        if not self.actors:
            return
        self.ship_all()
        log.info("ray: %d host(s) shipped %d bytes of run folder to %s", len(self.actors), self.shipped_bytes,
                 self.plan.run_dir)
        prefix = self.plan.flow.broker.shm_prefix
        closing = [actor.close.remote(prefix, pids.get(host, [])) for host, actor in self.actors.items()]
        ray.wait(closing, num_returns=len(closing), timeout=30)
        for actor in self.actors.values():
            ray.kill(actor)
        self.actors.clear()


def _moved(path: str | None, driver_run: str | None, host_run: str) -> str | None:
    """`path` under the host's run folder when it is under the driver's."""
    relative = _inside(path, driver_run)
    return path if relative is None else str(Path(host_run) / relative)


def _inside(path: str | None, run_dir: str | None) -> Path | None:
    """`path` relative to `run_dir` (None when it is not under it)."""
    if path is None or run_dir is None:
        return None
    inside = Path(path).resolve()
    run = Path(run_dir).resolve()
    if inside != run and run not in inside.parents:
        return None
    return inside.relative_to(run)
