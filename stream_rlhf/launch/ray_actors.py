"""The Ray launcher's actors (`launch/ray_job.py`): what runs in the Ray workers of a job.

    BrokerActor    the broker: `open` binds it (its node's address and the plan's keys across
                   hosts, and the weight-sync groups' address book there), `serve` runs its loop
    RankActor      a rank of a stage instance (`run`: `launch/rank.py` run_stage), or the one
                   process of a device group (`run_group`: run_device_group, every member)

Every actor says where it runs (`where`: node, IP, host id, pid, GPUs), which the driver logs and
checks. A worker starts in Ray's folder: it moves to the driver's (the config's relative paths are
relative to it) and runs as the host id the driver gives it. Ray itself is imported only when an
actor's method runs.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import tempfile
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from stream_rlhf.broker.payload.shm import host_id
from stream_rlhf.broker.sockets import CurveKeys, private_key_dir
from stream_rlhf.launch.plan import JobPlan
from stream_rlhf.launch.spec import StageSpec, setup_logging

log = logging.getLogger(__name__)


class _Worker:
    """What every actor of the job answers: where it runs."""

    def where(self) -> dict[str, Any]:
        """The Ray node, its IP, the machine's name and host id, the worker's pid and the GPUs Ray gave it."""
        import ray

        return {"node": ray.get_runtime_context().get_node_id(), "ip": ray.util.get_node_ip_address(),
                "host": socket.gethostname(), "host_id": host_id(), "pid": os.getpid(),
                "gpus": [str(g) for g in ray.get_gpu_ids()]}


class BrokerActor(_Worker):
    """The broker in a Ray worker: `open` binds it, `serve` runs its loop on an actor thread."""

    def open(self, plan: JobPlan, cwd: str, host: str, trace_folder: str | None) -> tuple[str, str | None]:
        """Bind the broker: on its node's address with the plan's keys when the plan spans hosts,
        and then serve the weight-sync groups' address book there too. Returns both addresses."""
        import ray

        from stream_rlhf.broker.control.server import BrokerServer
        from stream_rlhf.broker.control.topology import CurveConfig
        from stream_rlhf.telemetry import trace
        from stream_rlhf.weights.address_book import host_book

        _enter(cwd, host, None, None)
        flow = plan.flow
        if trace_folder is not None:
            trace.start(trace_folder, "broker", "broker")
        config = flow.broker
        self.key_dir = tempfile.mkdtemp(prefix="srlhf-keys-") if plan.keys is not None else None
        if plan.keys is not None:
            config = replace(config, curve=CurveConfig(str(plan.keys.write(self.key_dir))))
        book = None
        if plan.spans_hosts:
            config = replace(config, address=f"tcp://{ray.util.get_node_ip_address()}:*")
            self.book, book = host_book(ray.util.get_node_ip_address())
        self.server = BrokerServer(flow.topology, config, flow.admission)
        return self.server.address, book

    def serve(self) -> dict[str, float]:
        try:
            return self.server.serve()
        finally:
            if self.key_dir is not None:
                shutil.rmtree(self.key_dir, ignore_errors=True)

    def request_stop(self) -> None:
        self.server.request_stop()


class RankActor(_Worker):
    """One rank of a stage instance, or the one process of a device group, in a Ray worker."""

    def rendezvous(self) -> str:
        """A TCP rendezvous for the rank group this actor leads, on its node."""
        import ray

        ip = ray.util.get_node_ip_address()
        with socket.socket() as probe:
            probe.bind((ip, 0))
            return f"tcp://{ip}:{probe.getsockname()[1]}"

    def run(self, stage: str, instance_id: str, spec: StageSpec, address: str, keys: CurveKeys | None, prefix: str,
            rank: int, init_method: str | None, cwd: str, host: str, book: str | None, payloads: str | None) -> None:
        from stream_rlhf.launch.rank import run_stage

        _in_worker(f"{instance_id}: rank {rank}", cwd, host, book, payloads, keys,
                   lambda key_dir: run_stage(stage, instance_id, spec, address, key_dir, prefix, rank, init_method))

    def run_group(self, group: str, index: int, members: dict[str, StageSpec], address: str, keys: CurveKeys | None,
                  prefix: str, rank: int, init_method: str | None, cwd: str, host: str, book: str | None,
                  payloads: str | None) -> None:
        """Rank `rank` of every member of device group `group` in this worker, taking turns on its device."""
        from stream_rlhf.launch.rank import run_device_group

        _in_worker(f"{group}-{index} ({', '.join(members)}): rank {rank}", cwd, host, book, payloads, keys,
                   lambda key_dir: run_device_group(group, index, members, address, key_dir, prefix, rank,
                                                    init_method))


def _in_worker(process: str, cwd: str, host: str, book: str | None, payloads: str | None, keys: CurveKeys | None,
               run: Callable[[str | None], None]) -> None:
    """`run(key_dir)` in a rank's worker (`_enter`), the keys in a private folder; an error is
    logged naming `process`, then raised to the driver."""
    from stream_rlhf.telemetry import trace

    _enter(cwd, host, book, payloads)
    try:
        with private_key_dir(keys) as key_dir:
            run(key_dir)
    except BaseException:
        log.exception("%s failed", process)
        raise
    finally:
        trace.stop()


def _enter(cwd: str, host: str, book: str | None, payloads: str | None) -> None:
    """A worker starts in Ray's folder: run in the driver's (the config's relative paths are
    relative to it), as host `host` (the host id its payloads and the broker's segment checks go
    by), its weight-sync groups meeting through `book` (None: a folder beside the weight store),
    its payloads served to other hosts by its host's server `payloads` (None: its own)."""
    from stream_rlhf.broker.payload.host_server import HOST_SERVER_ENV
    from stream_rlhf.weights.address_book import BOOK_ENV

    setup_logging()
    os.environ["STREAM_RLHF_HOST_ID"] = host
    if book is not None:
        os.environ[BOOK_ENV] = book
    if payloads is not None:
        os.environ[HOST_SERVER_ENV] = payloads
    if os.path.isdir(cwd):
        os.chdir(cwd)
