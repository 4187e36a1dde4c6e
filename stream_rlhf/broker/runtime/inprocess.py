"""Runs a whole topology in one process, without sockets: the same BrokerCore routes, the same
StageHost calls each stage, tensors stay in a MemoryTransport. For unit tests of stage logic.
A stage with several inputs in flight (`Stage.inputs_in_flight()` > 1) is driven one input at a
time here: begun, then advanced until that input has ended (whatever ends on the way is published).

    bus = InProcessBus(topology)
    bus.add("prompts", PromptSource(), instances=1)
    bus.add("worker", Worker(), instances=2)
    stats = bus.run()
"""

from __future__ import annotations

import logging
import time
from collections import deque

from stream_rlhf.broker.control.admission import Admission
from stream_rlhf.broker.control.core import BrokerCore
from stream_rlhf.broker.control.messages import (
    SCHEMA_VERSION,
    Ack,
    Control,
    ControlOp,
    Deliver,
    Error,
    Hello,
    Message,
    Ready,
    Release,
    Request,
)
from stream_rlhf.broker.control.topology import BrokerConfig, Topology
from stream_rlhf.broker.payload.memory_transport import MemoryTransport
from stream_rlhf.broker.runtime.host import StageHost
from stream_rlhf.broker.runtime.in_flight import inputs_in_flight
from stream_rlhf.stage import Stage, StageContext

log = logging.getLogger(__name__)


class InProcessBus:
    def __init__(self, topology: Topology, config: BrokerConfig | None = None, admission: Admission | None = None):
        self.core = BrokerCore(topology, config or BrokerConfig(), time.monotonic(), admission)
        self.transport = MemoryTransport()
        self.hosts: dict[bytes, StageHost] = {}
        self._to_broker: deque[tuple[bytes, Message]] = deque()
        self._deliveries: dict[bytes, deque[Deliver]] = {}

    def add(self, stage_name: str, stage: Stage, instances: int = 1) -> None:
        """Add `instances` instances of one stage. With several, pass a fresh Stage per call or
        one that keeps no per-instance state."""
        for _ in range(instances):
            instance_id = f"{stage_name}-{sum(h.stage_name == stage_name for h in self.hosts.values())}"
            peer = instance_id.encode()
            host = StageHost(
                stage, stage_name, instance_id, self.transport,
                lambda m, p=peer: self._to_broker.append((p, m)), wait_for_credit=False,
            )
            self.hosts[peer] = host
            self._deliveries[peer] = deque()
            self._to_broker.append((peer, Hello(SCHEMA_VERSION, stage_name, instance_id)))

    def run(self, max_turns: int = 1_000_000) -> dict[str, float]:
        """Route and step until nothing is left to do; returns the broker's counters."""
        self._pump()
        for peer, host in self.hosts.items():
            host.stage.setup(StageContext(
                host.stage_name, host.instance_id, host.inputs, host.outputs,
                lambda op, version, p=peer: self._control(p, op, version),
                logging.LoggerAdapter(log, {"stage": host.instance_id}), host.abort,
            ))
            host.allow_in_flight(inputs_in_flight(host.stage, host.stage_name, ranks=1))
        for _ in range(max_turns):
            progressed = False
            for peer, host in self.hosts.items():
                if self._deliveries[peer]:
                    self._take(host, self._deliveries[peer].popleft())
                    progressed = True
                elif host.can_produce():
                    host.produce()
                    progressed = True
                self._pump()
            if not progressed:
                break
        for host in self.hosts.values():
            host.stage.close()
        return dict(self.core.snapshot())

    def _take(self, host: StageHost, deliver: Deliver) -> None:
        if host.in_flight.limit == 1:
            host.process(deliver)
            return
        host.begin(deliver)
        while host.in_flight:
            host.advance()
            self._pump()  # the publishes' credit, controls (weights_ready) between advances

    def _control(self, peer: bytes, op: ControlOp, version: int) -> None:
        self._to_broker.append((peer, Control(op, "*", version)))

    def _pump(self) -> None:
        while self._to_broker:
            while self._to_broker:
                peer, message = self._to_broker.popleft()
                self.core.handle(peer, message, time.monotonic())
            for peer, message in self.core.flush():
                self._to_stage(peer, message)

    def _to_stage(self, peer: bytes, message: Message) -> None:
        host = self.hosts[peer]
        if isinstance(message, Deliver):
            self._deliveries[peer].append(message)
        elif isinstance(message, Ready):
            host.on_ready(message)
        elif isinstance(message, Request):
            host.on_producer_credit(message)
        elif isinstance(message, Ack):
            host.on_confirmed(message)
        elif isinstance(message, Release):
            host.on_release(message)
        elif isinstance(message, Control) and message.op == "weights_ready":
            host.stage.on_weights(message.version)
        elif isinstance(message, Error):
            raise RuntimeError(f"broker rejected a message from {host.instance_id}: {message.reason}")
