"""Which specialisations of the Triton kernels this process has launched: one compile each on CUDA.

    launch(kernel, grid, args, meta)      # every Triton launch of kernels/triton_logprob.py goes here
    seen = specialisations()              # frozenset of keys: its size is the count of compiles
    with trace.span(...)                  # a launch of a key not seen before is a "triton compile" span

Triton compiles a kernel once per *specialisation*: the constexpr values (`meta`: tile sizes,
flags) and, for every other argument, its class under Triton's rules (3.x, `runtime/jit.py`): a
tensor by its dtype and whether its address is 16-byte aligned, an int by whether it is 1 and
whether it is divisible by 16 (unless the kernel names it in `do_not_specialize`), a float not at
all. `specialisation_key` applies those rules, so on CUDA a new key is a compile (seconds inside
a training step when it happens there) and on the CPU, under `TRITON_INTERPRET=1` where nothing
compiles, the set still says which compiles a GPU run would have paid. The engines warm the
kernels at setup (`kernels/warm_up.py`) so that steady-state steps add no key.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from stream_rlhf.telemetry import trace

UNSPECIALISED = ("T",)
"""Kernel arguments Triton must not specialise: the token count T of the hidden-state kernels
enters only masks and loop bounds, so every length runs one compiled kernel (`do_not_specialize`)."""

_seen: set[tuple] = set()


def _argument_class(name: str, value: Any) -> tuple:
    """An argument's part of the key, by Triton's specialisation rules (module docstring)."""
    if isinstance(value, torch.Tensor):
        return (name, str(value.dtype), value.data_ptr() % 16 == 0)
    if isinstance(value, bool) or name in UNSPECIALISED:
        return (name, type(value).__name__)
    if isinstance(value, int):
        return (name, "int", value == 1, value % 16 == 0)
    return (name, type(value).__name__)  # floats: never specialised


def specialisation_key(kernel_name: str, args: dict[str, Any], meta: dict[str, Any]) -> tuple:
    """What decides whether a launch with these arguments reuses a compiled kernel."""
    return (kernel_name, *(_argument_class(n, v) for n, v in args.items()), *sorted(meta.items()))


def launch(kernel: Any, grid: Sequence[int], args: dict[str, Any], meta: dict[str, Any]) -> None:
    """kernel[grid](**args, **meta), recorded; the first launch of a key is traced as its compile."""
    name = kernel.fn.__name__  # a JITFunction, or an InterpretedFunction under TRITON_INTERPRET=1
    key = specialisation_key(name, args, meta)
    if key in _seen:
        kernel[tuple(grid)](**args, **meta)
        return
    with trace.span(f"triton compile {name}", "compile", **{k: str(v) for k, v in meta.items()}):
        kernel[tuple(grid)](**args, **meta)
    _seen.add(key)


def specialisations() -> frozenset[tuple]:
    """Every key launched in this process so far."""
    return frozenset(_seen)
