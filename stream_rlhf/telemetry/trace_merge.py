"""Merges a run's per-process trace event files (`trace.py`) into one Trace Event JSON file.

    merged = merge_trace(run_dir / "trace_events", run_dir / "trace.json",
                         sources=topic_sources(topology), order=["prompts", "rollout", ...],
                         metrics=read_metrics(run_dir / "metrics.jsonl"))

trace.json is `{"traceEvents": [...], "displayTimeUnit": "ms", "otherData": {...}}`, the JSON
format chrome://tracing and https://ui.perfetto.dev open. What the merge adds to the recorded
events:

- Tracks. Each process name becomes a pid (stage instances in the dataflow order `order`, then
  the broker) and each thread name a tid of it ("rank r" -> r, another thread of the process ->
  1000 + n); "M" events name them (`process_name`, `thread_name`) and keep that order
  (`process_sort_index`). A rank that recorded nothing but its start still has its track.
- Flows. A step whose input topic is reached from producer stages (`sources`, a join expanded
  into the producers of its parts) gets an arrow from each producer's step of the same
  (iteration, mini-batch): an "s" event at the producer step's end, an "f" event at the consumer
  step's start, both bound to the enclosing slice ("bp": "e"). The arrows of one mini-batch lead
  from the prompt source through rollout and the forwards to the trainers. Flow id:
  (iteration * 4096 + mini-batch) * 256 + the edge's index among every (producer, consumer) pair.
- Staleness. A "C" counter `staleness` (mean and max, from metrics.jsonl) on actor_train's track
  at the end of each trained iteration.
- One clock. The events files of another host than the driver's (named in the folder's
  clocks.json, `trace_clocks.py`) are shifted by that host's measured clock offset, so the steps of
  one iteration line up across hosts; the driver host's events keep their timestamps.

A line that does not parse (the torn last line of a killed process) is skipped and counted in
otherData.lines_skipped, so a trace is written after a failure too.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stream_rlhf.atomic_file import write_text_atomically
from stream_rlhf.telemetry.trace_clocks import read_shifts
from stream_rlhf.telemetry.trace_figures import TRAINER, is_leader_step

if TYPE_CHECKING:  # the broker's graph, read only: the broker itself writes traces
    from stream_rlhf.broker.control.topology import Topology

BROKER = "broker"
OTHER_THREADS = 1000
"""tids of threads other than a rank's own start here."""
CLOCK = "wall clock (time.time_ns) of the driver's host, microseconds since the epoch"


@dataclass(frozen=True)
class MergedTrace:
    events: list[dict[str, Any]]
    """Every event of trace.json, numbered tracks and flows included."""
    lines_skipped: int
    files: int


def topic_sources(topology: Topology) -> dict[str, list[str]]:
    """Topic -> the stages whose outputs reach it (a join: the producers of its parts)."""
    topics = topology.topics

    def producers(topic: str) -> list[str]:
        config = topics[topic]
        if not config.join:
            return list(config.producers)
        return sorted({stage for part in config.join for stage in producers(part)})

    return {topic: producers(topic) for topic in topics}


def read_events(folder: Path) -> tuple[list[dict[str, Any]], int, int]:
    """The events of every file in `folder` (on the driver's clock), the lines skipped, and the files
    read."""
    events, skipped = [], 0
    files = sorted(folder.glob("*.jsonl")) if folder.is_dir() else []
    shifts = read_shifts(folder) if files else {}
    for path in files:
        shift = shifts.get(path.name, 0)
        for line in path.read_text(errors="replace").splitlines():
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                skipped += 1
                continue
            if isinstance(event, dict) and isinstance(event.get("pid"), str) and isinstance(event.get("tid"), str):
                if shift and isinstance(event.get("ts"), int):
                    event["ts"] += shift
                events.append(event)
            else:
                skipped += 1
    return events, skipped, len(files)


def merge_trace(folder: Path, out: Path, sources: dict[str, list[str]], order: Iterable[str] = (),
                metrics: list[dict[str, Any]] = ()) -> MergedTrace:
    """Write trace.json (`out`, replaced atomically) from the files in `folder`; see the module
    docstring."""
    recorded, skipped, files = read_events(folder)
    pids, tids = _number_tracks(recorded, list(order))
    events = _track_names(pids, tids)
    for event in recorded:
        if event.get("ph") != "M":
            events.append({**event, "pid": pids[event["pid"]], "tid": tids[(event["pid"], event["tid"])]})
    steps = [e for e in events if is_leader_step(e)]  # arrows between stage instances, not their ranks
    events += _flows(steps, sources)
    events += _staleness(steps, metrics)
    events.sort(key=lambda e: (e["ph"] != "M", e.get("ts", 0)))
    write_text_atomically(out, json.dumps({"traceEvents": events, "displayTimeUnit": "ms",
                                           "otherData": {"clock": CLOCK, "lines_skipped": skipped, "files": files}},
                                          separators=(",", ":")))
    return MergedTrace(events, skipped, files)


def _number_tracks(events: list[dict[str, Any]],
                   order: list[str]) -> tuple[dict[str, int], dict[tuple[str, str], int]]:
    def process_key(name: str) -> tuple[int, str, int]:
        stage, _, index = name.rpartition("-")
        position = order.index(stage) if stage in order else len(order) + (name == BROKER)
        return position, stage or name, int(index) if index.isdigit() else 0

    processes = sorted({e["pid"] for e in events}, key=process_key)
    pids = {name: number for number, name in enumerate(processes, start=1)}
    tids: dict[tuple[str, str], int] = {}
    for process in processes:
        threads = sorted({e["tid"] for e in events if e["pid"] == process})
        others = [t for t in threads if _rank(t) is None]
        for thread in threads:
            rank = _rank(thread)
            tids[(process, thread)] = rank if rank is not None else OTHER_THREADS + others.index(thread)
    return pids, tids


def _rank(thread: str) -> int | None:
    kind, _, number = thread.partition(" ")
    return int(number) if kind == "rank" and number.isdigit() else None


def _track_names(pids: dict[str, int], tids: dict[tuple[str, str], int]) -> list[dict[str, Any]]:
    names: list[dict[str, Any]] = []
    for process, pid in pids.items():
        names.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": process}})
        names.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": pid}})
    for (process, thread), tid in tids.items():
        names.append({"ph": "M", "name": "thread_name", "pid": pids[process], "tid": tid, "args": {"name": thread}})
    return names


def _flows(steps: list[dict[str, Any]], sources: dict[str, list[str]]) -> list[dict[str, Any]]:
    by_key: dict[tuple[str, int, int], list[dict[str, Any]]] = {}
    for step in steps:
        args = step["args"]
        by_key.setdefault((args["stage"], args["iteration"], args["minibatch"]), []).append(step)
    edges = sorted({(producer, consumer) for topic, producers in sources.items() for producer in producers
                    for consumer in {s["args"]["stage"] for s in steps if s["args"]["topic"] == topic}})
    flows, used = [], set()
    for step in steps:
        args = step["args"]
        iteration, minibatch = args["iteration"], args["minibatch"]
        if iteration is None or minibatch is None or iteration < 0 or minibatch < 0:
            continue
        for producer in sources.get(args["topic"], []):
            before = [s for s in by_key.get((producer, iteration, minibatch), []) if s["ts"] + s["dur"] <= step["ts"]]
            if not before:
                continue
            flow_id = (iteration * 4096 + minibatch) * 256 + edges.index((producer, args["stage"]))
            if flow_id in used:  # a redelivered mini-batch: its first arrow stands
                continue
            used.add(flow_id)
            source = max(before, key=lambda s: s["ts"])
            common = {"name": "minibatch", "cat": "flow", "id": flow_id, "bp": "e"}
            flows.append({**common, "ph": "s", "ts": source["ts"] + max(source["dur"] - 1, 0),
                          "pid": source["pid"], "tid": source["tid"]})
            flows.append({**common, "ph": "f", "ts": step["ts"], "pid": step["pid"], "tid": step["tid"]})
    return flows


def _staleness(steps: list[dict[str, Any]], metrics: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    last: dict[int, dict[str, Any]] = {}
    for step in steps:
        if step["args"]["stage"] == TRAINER:
            iteration = step["args"]["iteration"]
            if iteration not in last or step["ts"] + step["dur"] > last[iteration]["ts"] + last[iteration]["dur"]:
                last[iteration] = step
    counters = []
    for record in metrics:
        step = last.get(record.get("iteration"))
        if step is not None and "staleness_max" in record:
            counters.append({"ph": "C", "name": "staleness", "ts": step["ts"] + step["dur"], "pid": step["pid"],
                             "tid": step["tid"], "args": {"mean": record.get("staleness_mean", 0.0),
                                                          "max": record["staleness_max"]}})
    return counters
