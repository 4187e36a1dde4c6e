"""Start a real broker process for a test and stop it cleanly; read its counters as they move."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import time
from collections.abc import Callable
from pathlib import Path

import zmq

from stream_rlhf.broker.control.client import ControlClient
from stream_rlhf.broker.control.topology import BrokerConfig, TopicConfig, Topology
from stream_rlhf.launch.local import _broker_main

TOPOLOGY = Topology({"items": TopicConfig(producers=["src"], consumers=["sink"])})


@contextlib.contextmanager
def broker_process(config: BrokerConfig, topology: Topology = TOPOLOGY, log_path: Path | None = None):
    """A broker process; with `log_path`, its stderr (every log line) goes to that file."""
    ctx = mp.get_context("spawn")
    address_queue = ctx.Queue()
    process = ctx.Process(target=_broker_logging_to, args=(log_path, topology, config, address_queue), name="broker")
    process.start()
    try:
        yield process, address_queue.get(timeout=30)
    finally:
        process.terminate()
        process.join(10)
        if process.is_alive():
            process.kill()


def _broker_logging_to(log_path: Path | None, topology: Topology, config: BrokerConfig, address_queue) -> None:
    if log_path is not None:
        with open(log_path, "w") as log_file:
            os.dup2(log_file.fileno(), 2)
    _broker_main(topology, config, address_queue, None)


def stats_once(address: str, done: Callable[[dict[str, float]], bool], timeout_s: float = 30.0) -> dict[str, float]:
    """The broker's counters once `done(counters)` holds (asked every 0.1 s), or the last ones
    after `timeout_s`: frames sent on another connection may still wait to be read."""
    deadline = time.monotonic() + timeout_s
    with ControlClient(address) as client:
        while True:
            stats = client.stats()
            if done(stats) or time.monotonic() > deadline:
                return stats
            time.sleep(0.1)


def raw_dealer(address: str, identity: bytes | None = None) -> tuple[zmq.Context, zmq.Socket]:
    """A bare DEALER to the broker (no handshake): what a broken or hostile peer holds."""
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.linger = 0
    if identity is not None:
        sock.routing_id = identity
    sock.connect(address)
    return context, sock
