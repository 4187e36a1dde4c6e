"""A weight-sync receiver in a spawned process, driven by the tests over a pipe (light imports only).

    with receiver_process(folder, "rollout-0", rank=1, world_size=2) as receiver:   # or transport="cuda_ipc"
        receiver.ask(min_version=1)            # the child calls receive(min_version=1)
        version, tensors = receiver.answer()   # ... and sends back what it got
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
from collections.abc import Iterator
from multiprocessing.connection import Connection
from pathlib import Path

import torch

from stream_rlhf.weights.broadcast import BroadcastReceiver
from stream_rlhf.weights.buckets import dtype_name, parse_dtype
from stream_rlhf.weights.cuda_ipc import CudaIpcReceiver

Wire = list[tuple[str, str, tuple[int, ...], bytes]]  # (name, dtype, shape, raw bytes)


def to_wire(named: list[tuple[str, torch.Tensor]]) -> Wire:
    return [(name, dtype_name(t.dtype), tuple(t.shape),
             t.cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
            for name, t in named]


def from_wire(wire: Wire) -> dict[str, torch.Tensor]:
    return {name: torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(parse_dtype(dtype)).view(shape)
            for name, dtype, shape, raw in wire}


def _main(conn: Connection, transport: str, folder: Path, name: str, rank: int, world_size: int,
          timeout_s: float) -> None:
    torch.set_num_threads(1)
    try:
        if transport == "cuda_ipc":
            receiver = CudaIpcReceiver.join(folder, name, timeout_s)
        else:
            receiver = BroadcastReceiver.join(folder, name, rank, world_size, "gloo", timeout_s)
    except Exception as exc:  # noqa: BLE001 - reported to the test
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("joined", None))
    while (command := conn.recv()) is not None:
        try:
            version, named = receiver.receive(min_version=command)
        except Exception as exc:  # noqa: BLE001 - reported to the test
            conn.send(("error", f"{type(exc).__name__}: {exc}"))
            return
        conn.send(("got", (version, to_wire(named))))
    receiver.close()


class ReceiverProcess:
    def __init__(self, conn: Connection, process: mp.Process):
        self.conn = conn
        self.process = process

    def joined(self, timeout_s: float = 20.0) -> None:
        kind, detail = self._reply(timeout_s)
        assert kind == "joined", detail

    def ask(self, min_version: int = 0) -> None:
        self.conn.send(min_version)

    def kill(self) -> None:
        """SIGKILL the receiver (what a crash of its rollout does) and wait for it to be gone."""
        self.process.kill()
        self.process.join(10)

    def answered(self, within_s: float) -> bool:
        return self.conn.poll(within_s)

    def failure(self, timeout_s: float = 20.0) -> str:
        kind, detail = self._reply(timeout_s)
        assert kind == "error", kind
        return detail

    def answer(self, timeout_s: float = 20.0) -> tuple[int, dict[str, torch.Tensor]]:
        kind, detail = self._reply(timeout_s)
        assert kind == "got", detail
        version, wire = detail
        return version, from_wire(wire)

    def _reply(self, timeout_s: float) -> tuple[str, object]:
        if not self.conn.poll(timeout_s):
            raise TimeoutError(f"receiver {self.process.name} sent nothing within {timeout_s}s "
                               f"(alive: {self.process.is_alive()})")
        return self.conn.recv()


@contextlib.contextmanager
def receiver_process(folder: Path, name: str, rank: int = 1, world_size: int = 2, timeout_s: float = 20.0,
                     transport: str = "broadcast") -> Iterator[ReceiverProcess]:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    process = ctx.Process(target=_main, args=(child, transport, folder, name, rank, world_size, timeout_s),
                          name=f"{name} rank {rank}", daemon=True)
    process.start()
    try:
        yield ReceiverProcess(parent, process)
        if process.is_alive():
            parent.send(None)
            process.join(10)
    finally:
        if process.is_alive():
            process.terminate()
            process.join(5)
