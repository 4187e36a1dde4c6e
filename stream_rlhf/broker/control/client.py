"""A control-plane client for launchers and the CLI: send Control, read the broker's Stats.

    with ControlClient("tcp://127.0.0.1:5555") as client:
        client.control("weights_ready", version=3)
        print(client.stats()["delivered"])
"""

from __future__ import annotations

import os
import uuid

import zmq

from stream_rlhf.broker import sockets
from stream_rlhf.broker.control.messages import (
    SCHEMA_VERSION,
    Control,
    ControlOp,
    Error,
    Heartbeat,
    Hello,
    Message,
    Ready,
    Stats,
    decode,
    encode,
)
from stream_rlhf.broker.control.topology import CONTROL_STAGE


class HandshakeError(RuntimeError):
    """The broker did not answer HELLO in time, or refused it; the message says which and why."""


class ControlClient:
    def __init__(self, address: str, key_dir: str | None = None, timeout_s: float = 10.0):
        self.timeout_ms = int(timeout_s * 1000)
        self._context = zmq.Context()
        self.instance_id = f"control-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self._socket = sockets.dealer(self._context, address, self.instance_id, key_dir)
        self._socket.send(encode(Hello(SCHEMA_VERSION, CONTROL_STAGE, self.instance_id, [], os.getpid())))
        reply = self._receive(Ready)
        if reply is None:
            self.close()
            raise HandshakeError(f"no READY from broker {address} within {timeout_s}s")

    def control(self, op: ControlOp, target: str = "*", version: int = -1) -> None:
        self._socket.send(encode(Control(op, target, version)))

    def stats(self) -> dict[str, float]:
        self._socket.send(encode(Control("stats")))
        reply = self._receive(Stats)
        if reply is None:
            raise TimeoutError("broker did not answer a stats request")
        return dict(reply.counters)

    def _receive(self, kind: type) -> Message | None:
        while self._socket.poll(self.timeout_ms):
            message = decode(self._socket.recv())
            if isinstance(message, kind):
                return message
            if isinstance(message, Error) and message.fatal:
                raise HandshakeError(f"broker refused: {message.reason}")
        return None

    def close(self) -> None:
        try:  # leave now, not at the heartbeat timeout
            self._socket.send(encode(Heartbeat("stopped")), zmq.NOBLOCK)
        except zmq.Again:
            pass  # never connected
        self._socket.close(linger=100)
        self._context.term()

    def __enter__(self) -> ControlClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
