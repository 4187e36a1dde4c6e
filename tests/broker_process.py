"""Start a real broker process for a test and stop it cleanly."""

from __future__ import annotations

import contextlib
import multiprocessing as mp

from stream_rlhf.broker.topology import BrokerConfig, TopicConfig, Topology
from stream_rlhf.launch.local import _broker_main

TOPOLOGY = Topology({"items": TopicConfig(producers=["src"], consumers=["sink"])})


@contextlib.contextmanager
def broker_process(config: BrokerConfig, topology: Topology = TOPOLOGY):
    ctx = mp.get_context("spawn")
    address_queue = ctx.Queue()
    process = ctx.Process(target=_broker_main, args=(topology, config, address_queue, None), name="broker")
    process.start()
    try:
        yield process, address_queue.get(timeout=30)
    finally:
        process.terminate()
        process.join(10)
        if process.is_alive():
            process.kill()
