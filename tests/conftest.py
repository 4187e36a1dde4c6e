"""Shared fixtures: a unique shared-memory prefix per test, and a check that it leaves nothing."""

from __future__ import annotations

import os
import signal
import uuid

# Must precede any `import triton`: Triton kernels then run on CPU tensors (tests/test_kernels_*.py).
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from stream_rlhf.broker.payload import shm


@pytest.fixture
def shm_prefix():
    """A shared-memory prefix no other test or process uses; the test fails if segments leak."""
    prefix = f"t{uuid.uuid4().hex[:10]}"
    yield prefix
    left = shm.list_segments(prefix)
    for name, _ in left:
        shm.unlink(name)
    assert not left, f"shared-memory segments left behind: {left}"


@pytest.fixture
def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pytest_configure(config):
    os.environ.setdefault("PYTHONHASHSEED", "0")
    # A suite started in the background by a shell script (`(pytest &)`) inherits Ctrl-C ignored, and
    # so would every job it starts: the Ctrl-C tests would meet jobs that no SIGINT interrupts.
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
