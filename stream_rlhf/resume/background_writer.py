"""Checkpoint writes off the training thread: training hands a write over and goes on; the write
(files, checksums, manifest, rename into place, prune) runs in a thread of its own. Trainers
publish their weight versions the same way (`kind="weights"`, `stages/weight_publish.py`).

    writer = BackgroundWriter(background=cfg.checkpoint.background, name="actor checkpoint")
    writer.submit(version, lambda: store.write_part(version, "actor", fill))   # returns at once
    writer.wait()                   # at a stop (drain): the pending write is on disk when it returns

One write at a time: `submit` first waits for the one before it, so checkpoints land in order and a
snapshot's host memory is held for at most one write. A write that failed raises its error from
the next `submit` or `wait` (nothing is lost silently). With `background=False` a write runs
inside `submit`, as it always did.

What is written must no longer change: the caller takes a snapshot first (`host_snapshot.py`).
The write is mostly the kernel copying bytes into files, so its thread may run on every core of
the machine, not only the cores the stage is pinned to (`placement`): on a machine whose cores
are split between rollout and training, an idle moment of either side takes the write.
The thread is not a daemon, so a process that ends without a drain still finishes its write; one
that is killed leaves a staging folder that no reader picks (`store.py`).

Tests that stop a run during a write make each write last longer with the environment variable
`STREAM_RLHF_CHECKPOINT_WRITE_DELAY_S` (seconds; `write_delay` is where a write honours it).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

from stream_rlhf.telemetry import trace

WRITE_DELAY_VARIABLE = "STREAM_RLHF_CHECKPOINT_WRITE_DELAY_S"


def write_delay() -> None:
    """Sleep `STREAM_RLHF_CHECKPOINT_WRITE_DELAY_S` seconds if set: a write's files are then on disk
    and its manifest not yet, for that long (for tests that stop or kill a run in that moment)."""
    if delay := os.environ.get(WRITE_DELAY_VARIABLE):
        try:
            time.sleep(float(delay))
        except ValueError:
            raise ValueError(f"{WRITE_DELAY_VARIABLE}={delay!r}: expected seconds (a number)") from None


class BackgroundWriter:
    def __init__(self, background: bool, name: str, kind: str = "checkpoint"):
        self.background = background
        self.name = name
        """The thread's name (and its track in the trace)."""
        self.kind = kind
        """What is written: names the trace's spans ("<kind> write", "<kind> wait") and a failure."""
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def submit(self, version: int, write: Callable[[], None]) -> None:
        """Run `write` (checkpoint `version`'s) after the write before it: in the background, or
        now without `background`."""
        self.wait()
        if not self.background:
            with trace.span(f"{self.kind} write", self.kind, version=version, background=0):
                write()
            return
        self._thread = threading.Thread(target=self._run, args=(version, write), name=self.name)
        self._thread.start()

    def wait(self) -> None:
        """Until the pending write (if any) is done; raises what it raised."""
        if self._thread is not None:
            with trace.span(f"{self.kind} wait", self.kind):
                self._thread.join()
            self._thread = None
        if (error := self._error) is not None:
            self._error = None
            raise RuntimeError(f"{self.name}: a background {self.kind} write failed") from error

    def _run(self, version: int, write: Callable[[], None]) -> None:
        _float_over_every_core()
        try:
            with trace.span(f"{self.kind} write", self.kind, version=version, background=1):
                write()
        except BaseException as error:  # handed to the training thread at its next submit or wait
            self._error = error


def _float_over_every_core() -> None:
    """Let the calling thread (only it: pid 0 is the thread on Linux) run on every core this
    machine lets the process have."""
    if hasattr(os, "sched_setaffinity"):
        try:
            os.sched_setaffinity(0, range(os.cpu_count() or 1))
        except OSError:  # a cpuset narrower than the machine: keep the stage's cores
            pass
