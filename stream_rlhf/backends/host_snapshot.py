"""A copy of a training state in host memory that training can no longer change: what a
checkpoint writes in the background while the next steps run (`resume/background_writer.py`).

    snapshot = host_snapshot({"model": weights, "optimizer": optimizer_state, "rng": rng})
    torch.save(snapshot, path)      # later, on another thread: the state as it was

Device tensors are copied into pinned host memory asynchronously and waited for once at the end
(torch's caching host allocator hands the same pinned blocks to the next snapshot once this one
is freed); host tensors are cloned, since on the CPU the "copy to the CPU" of a live parameter or
optimizer moment is the tensor itself. Tensors that were one object stay one (tied weights).
"""

from __future__ import annotations

from typing import TypeVar

import torch
from torch import Tensor

State = TypeVar("State")


def host_snapshot(state: State) -> State:
    """`state` (nested dicts, lists and tuples of tensors and plain values) with every tensor
    copied into host memory of its own."""
    copies: dict[int, Tensor] = {}
    snapshot = _copy(state, copies)
    if any(t.is_pinned() for t in copies.values()):
        torch.cuda.synchronize()  # the non-blocking device -> pinned copies are complete
    return snapshot


def _copy(value: object, copies: dict[int, Tensor]) -> object:
    if isinstance(value, Tensor):
        if id(value) not in copies:
            copies[id(value)] = _host_copy(value.detach())
        return copies[id(value)]
    if isinstance(value, dict):
        return {key: _copy(item, copies) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_copy(item, copies) for item in value)
    return value


def _host_copy(tensor: Tensor) -> Tensor:
    if tensor.device.type == "cpu":
        return tensor.clone()
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    return host.copy_(tensor, non_blocking=True)
