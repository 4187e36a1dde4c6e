"""A copy of a training state in host memory that training can no longer change: what a
checkpoint writes in the background while the next steps run (`resume/background_writer.py`).

    snapshots = HostSnapshots()                                   # one per engine
    snapshot = snapshots.take({"model": weights, "optimizer": optimizer_state, "rng": rng})
    torch.save(snapshot, path)      # later, on another thread: the state as it was

Device tensors are copied into pinned host memory asynchronously and waited for once at the end;
host tensors are copied too, since on the CPU the "copy to the CPU" of a live parameter or
optimizer moment is the tensor itself. Tensors that were one object stay one (tied weights).
The host buffers are kept and filled again by the next `take` (a large fresh allocation costs
page faults, or a pinned registration, every time): write a snapshot before taking the next
(checkpoint saves do: a save waits for the write before it). `reserve` allocates them ahead, on a
thread of its own, so that not even the first `take` pays for them: pinning the host memory of a
358M model's weights and Adam moments (4.3 GB) took 4.7 s of a training step on an H200.

    snapshots.reserve(state_like)   # after the first optimizer step: the state's shapes are known
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import TypeVar

import torch
from torch import Tensor

State = TypeVar("State")


class HostSnapshots:
    def __init__(self) -> None:
        self._buffers: list[Tensor] = []
        """Host copies by their order in the state: reused while the tensor there keeps its shape and dtype."""
        self._reserving: threading.Thread | None = None

    def reserve(self, state: object) -> None:
        """Start allocating, on a thread of its own, the host buffers a `take` of `state` (or of a
        state with the same tensors' shapes and dtypes) fills; the next `take` waits for it."""
        self._join_reserve()
        wanted = [(t.shape, t.dtype, t.device.type != "cpu") for t in _tensors(state, set())]
        self._reserving = threading.Thread(target=self._allocate, args=(wanted,), name="snapshot buffers", daemon=True)
        self._reserving.start()

    def take(self, state: State) -> State:
        """`state` (nested dicts, lists and tuples of tensors and plain values) with every tensor
        copied into host memory of its own (this object's buffers, overwritten by the next `take`)."""
        self._join_reserve()
        copies: dict[int, Tensor] = {}
        snapshot = self._copy(state, copies)
        if any(t.is_pinned() for t in copies.values()):
            torch.cuda.synchronize()  # the non-blocking device -> pinned copies are complete
        del self._buffers[len(copies):]
        return snapshot

    def _join_reserve(self) -> None:
        if self._reserving is not None:
            self._reserving.join()
            self._reserving = None

    def _allocate(self, wanted: list[tuple[torch.Size, torch.dtype, bool]]) -> None:
        self._buffers = [torch.empty(shape, dtype=dtype, pin_memory=pinned) for shape, dtype, pinned in wanted]

    def _copy(self, value: object, copies: dict[int, Tensor]) -> object:
        if isinstance(value, Tensor):
            if id(value) not in copies:
                copies[id(value)] = self._host_copy(len(copies), value.detach())
            return copies[id(value)]
        if isinstance(value, dict):
            return {key: self._copy(item, copies) for key, item in value.items()}
        if isinstance(value, list | tuple):
            return type(value)(self._copy(item, copies) for item in value)
        return value

    def _host_copy(self, index: int, tensor: Tensor) -> Tensor:
        pinned = tensor.device.type != "cpu"
        if index < len(self._buffers):
            buffer = self._buffers[index]
            if buffer.shape != tensor.shape or buffer.dtype != tensor.dtype or buffer.is_pinned() != pinned:
                buffer = self._buffers[index] = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=pinned)
        else:
            buffer = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=pinned)
            self._buffers.append(buffer)
        return buffer.copy_(tensor, non_blocking=pinned)


def _tensors(value: object, seen: set[int]) -> Iterator[Tensor]:
    """The tensors of a state in the order `take` copies them, each object once."""
    if isinstance(value, Tensor):
        if id(value) not in seen:
            seen.add(id(value))
            yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item, seen)
    elif isinstance(value, list | tuple):
        for item in value:
            yield from _tensors(item, seen)
