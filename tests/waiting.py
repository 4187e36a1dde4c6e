"""Waiting in tests for something to happen (a counter, a file, a process state), never for a fixed time.

    wait_for(lambda: len(read_records(out)) >= 5, 60, "the first 5 outputs")

polls the condition until it holds and fails naming what it waited for once the deadline passes.
A predicate may assert what must stay true meanwhile (`process.poll() is None`): that fails at once.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_for(predicate: Callable[[], T], timeout_s: float, what: str, interval_s: float = 0.02,
             detail: Callable[[], str] | None = None) -> T:
    """The first truthy value of `predicate()`, asked every `interval_s`; TimeoutError naming `what`
    once `timeout_s` passed without one, followed by `detail()` if given (a log's tail)."""
    deadline = time.monotonic() + timeout_s
    while not (result := predicate()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout_s:g}s for {what}" + (f"\n{detail()}" if detail else ""))
        time.sleep(interval_s)
    return result
