"""Records this process's part of a run's trace: one events file per process, appended without locks.

    trace.start(run_dir / "trace_events", process="rollout-0", thread="rank 0")   # once, at process start
    with trace.span("fetch", "payload", topic="rollout"):                         # anywhere in the process
        ...
    trace.complete("rollout prompts", "step", start_ns, trace.now_ns(), iteration=3, minibatch=1)
    trace.counter("queue rollout>ref_forward", depth=4)
    trace.complete_on("episode 003", "tool wait ep 3", "tool", start_ns, end_ns)   # on a track of its own

Every call is a no-op until `start` (a test running a stage in-process, a run with `trace: false`),
so library code records its events unconditionally. Each event is one line of Trace Event JSON
(https://docs.google.com/document/d/1CvAClvFfyA5R-PhYUmn5OOQtYMH4h6I0nSsKchNAySU) in the file
`<folder>/<process>.<thread>.<os pid>.jsonl`, written with one `write` call (line-buffered: a
process killed mid-run leaves every event it finished but at most one torn last line), except that
`pid` and `tid` are still names: "rollout-0" and "rank 0", or "rank 0/<thread name>" for an event
from another thread of the process (a weight sender's serving thread), or "rank 0/<track>" for
an event `complete_on` puts on a track of its own (an episode's tool waits). `trace_merge.py` turns the
names into numbered, named tracks and writes runs/<name>/trace.json.

Clock: `time.time_ns()`, the host's wall clock, in whole microseconds since the epoch (`ts`, and
`dur` as the difference of two such rounded timestamps). Every process of a local run reads the
same clock, so their events line up with no alignment step; across hosts the Ray launcher measures
each host's offset from the driver's clock and the merge shifts that host's events by it
(`trace_clocks.py`). A step lasts milliseconds to seconds, so a clock slew under NTP does
not change a duration measurably.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TextIO

FOLDER = "trace_events"
"""The per-process files in runs/<name>/ (merged into trace.json at the end of the run)."""


def now_ns() -> int:
    """The trace's clock (see the module docstring)."""
    return time.time_ns()


class TraceRecorder:
    """Appends this process's events to its own file; thread-safe (one buffered write per event)."""

    def __init__(self, folder: Path, process: str, thread: str):
        folder.mkdir(parents=True, exist_ok=True)
        safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", f"{process}.{thread}")
        self.path = folder / f"{safe}.{os.getpid()}.jsonl"
        self.file: TextIO = self.path.open("a", buffering=1)
        self.process = process
        self.thread = thread
        self._main_ident = threading.get_ident()
        self.write({"ph": "M", "name": "thread_name", "args": {"name": thread}})  # its track, even if idle

    def write(self, event: dict[str, Any], track: str | None = None) -> None:
        """`track`: the event goes on "<thread>/<track>" instead of the calling thread's track."""
        event["pid"] = self.process
        event["tid"] = self._tid() if track is None else f"{self.thread}/{track}"
        self.file.write(json.dumps(event, separators=(",", ":")) + "\n")

    def _tid(self) -> str:
        if threading.get_ident() == self._main_ident:
            return self.thread
        return f"{self.thread}/{threading.current_thread().name}"

    def close(self) -> None:
        self.file.close()


_recorder: TraceRecorder | None = None


def start(folder: Path | str, process: str, thread: str) -> None:
    """Record this process's events from now on, as track `thread` of process `process`."""
    global _recorder
    stop()
    _recorder = TraceRecorder(Path(folder), process, thread)


def stop() -> None:
    global _recorder
    if _recorder is not None:
        _recorder.close()
        _recorder = None


def enabled() -> bool:
    return _recorder is not None


def complete(name: str, cat: str, start_ns: int, end_ns: int, **args: Any) -> None:
    """A complete ("X") event from `start_ns` to `end_ns` (both `now_ns()` readings)."""
    _complete(None, name, cat, start_ns, end_ns, args)


def complete_on(track: str, name: str, cat: str, start_ns: int, end_ns: int, **args: Any) -> None:
    """`complete` on the track "<thread>/<track>" of this process: for slices that overlap the
    thread's own (an episode's tool calls while the sampler decodes others)."""
    _complete(track, name, cat, start_ns, end_ns, args)


def _complete(track: str | None, name: str, cat: str, start_ns: int, end_ns: int, args: dict[str, Any]) -> None:
    if _recorder is None:
        return
    ts = start_ns // 1000
    _recorder.write({"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": end_ns // 1000 - ts, "args": args},
                    track=track)


@contextmanager
def span(name: str, cat: str, **args: Any) -> Iterator[None]:
    """The block as a complete event (also when it raises)."""
    if _recorder is None:
        yield
        return
    started = now_ns()
    try:
        yield
    finally:
        complete(name, cat, started, now_ns(), **args)


def counter(name: str, **values: float) -> None:
    """A counter ("C") sample now: one series per keyword."""
    if _recorder is None:
        return
    _recorder.write({"ph": "C", "name": name, "ts": now_ns() // 1000, "args": values})
