"""The megatron engine's offload: device storages emptied into pinned host memory and refilled.

    host = HostCopies()
    moved = host.offload("grads", [p.main_grad for p in params])   # bytes copied out; storages freed
    moved = host.onload("grads")                                    # same storages, same bytes, back

Megatron's DDP keeps the gradients (`main_grad`) and, with the distributed optimizer, the
parameters in contiguous buffers and hands out views of them; the distributed optimizer's fp32
shards are views of those again. Moving a tensor (`p.data = p.data.cpu()`, as the torch engine
does) would cut those aliases: the optimizer would step a copy the model never reads. So the
storages themselves move: each distinct storage behind the tensors of a kind is copied to a
pinned host buffer and resized to 0 bytes (its device memory goes back to the allocator); onload
resizes it again and copies the bytes back, and every view, at its own offset, sees them. The host
buffers are kept, so a policy that offloads every step pins memory once.
"""

from __future__ import annotations

import torch
from torch import Tensor


class HostCopies:
    def __init__(self) -> None:
        self._off: dict[str, list[tuple[torch.UntypedStorage, Tensor]]] = {}  # kind -> (storage, its bytes)
        self._buffers: dict[int, Tensor] = {}  # storage id -> host buffer, kept between round trips

    def offload(self, kind: str, tensors: list[Tensor]) -> int:
        """Copy the distinct storages behind `tensors` to host memory and empty them; the bytes
        copied. A kind already off, or a storage already empty (another kind's), is left alone."""
        if kind in self._off:
            return 0
        storages: dict[int, torch.UntypedStorage] = {}
        for tensor in tensors:
            storage = tensor.untyped_storage()
            if storage.nbytes() > 0:
                storages.setdefault(storage._cdata, storage)
        held = []
        for key, storage in storages.items():
            host = self._buffers.get(key)
            if host is None or host.numel() != storage.nbytes():
                host = self._buffers[key] = torch.empty(storage.nbytes(), dtype=torch.uint8,
                                                        pin_memory=storage.device.type == "cuda")
            host.copy_(_bytes_of(storage))  # synchronous: complete before the storage is freed
            held.append((storage, host))
        for storage, _ in held:
            storage.resize_(0)
        self._off[kind] = held
        return sum(host.numel() for _, host in held)

    def onload(self, kind: str) -> int:
        """Refill the storages `offload(kind)` emptied; the bytes copied (0 when `kind` is not off)."""
        held = self._off.pop(kind, [])
        for storage, host in held:
            storage.resize_(host.numel())
            _bytes_of(storage).copy_(host, non_blocking=True)
        return sum(host.numel() for _, host in held)


def _bytes_of(storage: torch.UntypedStorage) -> Tensor:
    """A flat uint8 tensor over all of `storage`."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
