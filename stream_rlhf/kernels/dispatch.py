"""Which implementation a kernel entry point runs: "triton" (fused kernels) or "torch" (eager).

    backend = backend_for(logits)      # "triton" on CUDA when triton imports, else "torch"
    previous = force_backend("torch")  # override hook for tests and benchmarks; None restores auto
    force_backend(previous)

Precedence: `force_backend(...)` > env `STREAM_RLHF_KERNELS=auto|triton|torch` (read once, at
import) > auto. Forcing "triton" on CPU tensors works under `TRITON_INTERPRET=1` (the tests do it).
Whether triton imports is detected once, here.
"""

from __future__ import annotations

import os
from typing import Literal, get_args

from torch import Tensor

Backend = Literal["triton", "torch"]
ENV_VAR = "STREAM_RLHF_KERNELS"

try:  # detected once; the CPU path never needs triton
    import triton  # noqa: F401

    TRITON_AVAILABLE = True
except ImportError:  # pragma: no cover - depends on the install
    TRITON_AVAILABLE = False


def parse_backend_env(value: str | None) -> Backend | None:
    """The env var's value -> a forced backend, or None for auto (unset, empty or "auto")."""
    choice = (value or "auto").strip().lower()
    if choice == "auto":
        return None
    if choice not in get_args(Backend):
        raise ValueError(f"{ENV_VAR}={value!r}: must be one of auto, triton, torch")
    return choice  # type: ignore[return-value]


_ENV_BACKEND: Backend | None = parse_backend_env(os.environ.get(ENV_VAR))
_forced: Backend | None = None


def force_backend(name: Backend | None) -> Backend | None:
    """Force every entry point onto `name` (None: back to env/auto); returns the previous override."""
    global _forced
    if name is not None and name not in get_args(Backend):
        raise ValueError(f"backend={name!r}: must be 'triton', 'torch' or None")
    previous, _forced = _forced, name
    return previous


def backend_for(t: Tensor) -> Backend:
    """The backend an entry point should use for tensor `t`."""
    choice = _forced if _forced is not None else _ENV_BACKEND
    if choice == "triton" and not TRITON_AVAILABLE:
        raise RuntimeError('triton backend forced but triton does not import: pip install -e ".[kernels]"')
    if choice is not None:
        return choice
    return "triton" if TRITON_AVAILABLE and t.is_cuda else "torch"
