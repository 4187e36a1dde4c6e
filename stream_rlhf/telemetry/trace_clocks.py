"""How far each host's trace clock is from the driver's, measured once per host and kept beside the
trace events, so that `trace_merge.py` puts every host's events on the driver's clock.

    offset = measure_offset(lambda: ray.get(actor.clock_ns.remote()))   # the driver asks a host
    clocks = HostClocks(driver_host)
    clocks.hosts[host] = offset
    clocks.files[host] = {"rollout-0.rank_0.4242.jsonl"}                 # that host's events files
    clocks.write(trace_folder)                                            # <trace folder>/clocks.json
    shifts = read_shifts(trace_folder)                                    # file -> microseconds to add

The measurement is NTP's: the driver reads its clock (t0), asks the host for its own (t1) and reads
its clock again when the answer is back (t2). Were the request and the answer equally fast, the host
read its clock at (t0 + t2) / 2 of the driver's, so offset = t1 - (t0 + t2) / 2, to within
(t2 - t0) / 2 whatever the two legs took. The round trip with the smallest t2 - t0 of several is
kept (the one least delayed by a busy scheduler). A host's events are shifted by -offset; events
from files the driver's own host wrote are not in `files` and keep their timestamps.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from stream_rlhf.atomic_file import write_text_atomically
from stream_rlhf.telemetry.trace import now_ns

CLOCKS = "clocks.json"
"""In the trace folder: every other host's clock offset and the events files that host wrote."""
ROUNDS = 8
"""Round trips per host; the shortest one gives the offset."""


@dataclass(frozen=True)
class ClockOffset:
    """A host's trace clock (`trace.now_ns`) minus the driver's, as one round trip measured it."""

    offset_ns: int
    uncertainty_ns: int
    """Half the round trip: the true offset is within offset_ns +- uncertainty_ns."""
    round_trips: int

    def describe(self) -> str:
        return (f"{self.offset_ns / 1e6:+.3f} ms from the driver's (+- {self.uncertainty_ns / 1e6:.3f} ms, "
                f"best of {self.round_trips} round trips)")


def measure_offset(host_clock: Callable[[], int], clock: Callable[[], int] = now_ns,
                   rounds: int = ROUNDS) -> ClockOffset:
    """The offset of the clock `host_clock` reads (over a round trip) from `clock` (the driver's)."""
    if rounds < 1:
        raise ValueError(f"rounds={rounds}: must be >= 1")
    best: tuple[int, int] | None = None  # (round trip, offset)
    for _ in range(rounds):
        t0 = clock()
        t1 = host_clock()
        t2 = clock()
        trip = t2 - t0
        if best is None or trip < best[0]:
            best = (trip, t1 - (t0 + t2) // 2)
    trip, offset = best
    return ClockOffset(offset, trip // 2, rounds)


@dataclass
class HostClocks:
    """The hosts of a job other than the driver's: their clock offsets and their events files."""

    driver_host: str
    hosts: dict[str, ClockOffset] = field(default_factory=dict)
    files: dict[str, set[str]] = field(default_factory=dict)
    """Host -> the names of the events files (in the trace folder) its processes wrote."""

    def write(self, folder: Path) -> None:
        """`folder`/clocks.json, replaced atomically."""
        record = {"driver_host": self.driver_host,
                  "hosts": {host: {**asdict(offset), "files": sorted(self.files.get(host, ()))}
                            for host, offset in sorted(self.hosts.items())}}
        write_text_atomically(folder / CLOCKS, json.dumps(record, indent=1))


def read_shifts(folder: Path) -> dict[str, int]:
    """Events file name -> microseconds to add to its timestamps (-offset of the host that wrote it);
    {} when the trace comes from one host."""
    path = folder / CLOCKS
    if not path.is_file():
        return {}
    hosts = json.loads(path.read_text())["hosts"]
    return {name: -round(record["offset_ns"] / 1000) for record in hosts.values() for name in record["files"]}
