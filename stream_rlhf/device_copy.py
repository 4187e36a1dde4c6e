"""Host-to-device copies that do not make the host wait: staged through pinned memory.

    ids = to_device(packed.input_ids, device)   # (R, C) on cuda:0, queued behind the kernels before it

A copy from pageable host memory to a CUDA device makes the host wait for the device (the driver
stages it through its own buffer first); from pinned memory with `non_blocking` it is queued on the
current stream like a kernel, so the host goes on building the next step's inputs. On the CPU, or
for a tensor already on the device, this is `tensor.to(device)`.
"""

from __future__ import annotations

import torch
from torch import Tensor


def to_device(tensor: Tensor, device: torch.device) -> Tensor:
    """`tensor` on `device`; host -> CUDA through pinned memory, without blocking the host."""
    if device.type == "cuda" and tensor.device.type == "cpu":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)
