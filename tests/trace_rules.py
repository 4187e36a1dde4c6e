"""The rules of the Trace Event Format that trace.json must keep, checked by the trace tests.

Perfetto's trace processor cannot run here: the `perfetto` package (0.59) ships no
trace_processor binary and downloads one on first use, and this machine reaches no host but the
package registries (no Debian, PyPI or npm package carries the binary). So the tests check the
rules the format sets (https://docs.google.com/document/d/1CvAClvFfyA5R-PhYUmn5OOQtYMH4h6I0nSsKchNAySU)
and that Perfetto's JSON importer relies on, themselves.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

PHASES = {"X", "C", "M", "s", "t", "f"}
METADATA = {"process_name", "thread_name", "process_sort_index", "thread_sort_index"}


def check_trace(trace: dict[str, Any]) -> list[str]:
    """Every broken rule, as a message naming the event; [] for a valid trace."""
    problems: list[str] = []
    if not isinstance(trace.get("traceEvents"), list):
        return ["no traceEvents list"]
    if trace.get("displayTimeUnit") not in ("ms", "ns"):
        problems.append(f"displayTimeUnit={trace.get('displayTimeUnit')!r}")
    events = trace["traceEvents"]
    named_pids = {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    named_threads = {(e["pid"], e["tid"]) for e in events if e.get("ph") == "M" and e.get("name") == "thread_name"}
    starts: Counter = Counter()
    finishes: Counter = Counter()
    for index, event in enumerate(events):
        where = f"event {index} {event.get('ph')}/{event.get('name')!r}"
        if event.get("ph") not in PHASES:
            problems.append(f"{where}: phase not one of {sorted(PHASES)}")
            continue
        if not isinstance(event.get("pid"), int) or not isinstance(event.get("tid"), int):
            problems.append(f"{where}: pid and tid must be integers")
            continue
        if not isinstance(event.get("name"), str):
            problems.append(f"{where}: no name")
        if event["ph"] == "M":
            if event["name"] not in METADATA or not isinstance(event.get("args"), dict):
                problems.append(f"{where}: unknown metadata or no args")
            continue
        if not isinstance(event.get("ts"), (int, float)):
            problems.append(f"{where}: no ts")
        if event["pid"] not in named_pids:
            problems.append(f"{where}: pid {event['pid']} has no process_name")
        if event["ph"] == "X":
            if not isinstance(event.get("dur"), (int, float)) or event["dur"] < 0:
                problems.append(f"{where}: dur missing or negative")
            if (event["pid"], event["tid"]) not in named_threads:
                problems.append(f"{where}: track {event['pid']}/{event['tid']} has no thread_name")
        elif event["ph"] == "C":
            args = event.get("args")
            if not isinstance(args, dict) or not args or not all(isinstance(v, (int, float)) for v in args.values()):
                problems.append(f"{where}: a counter's args must be numbers")
        else:
            if not isinstance(event.get("id"), int) or not isinstance(event.get("cat"), str):
                problems.append(f"{where}: a flow event needs an integer id and a cat")
                continue
            key = (event["cat"], event["id"])
            (starts if event["ph"] == "s" else finishes if event["ph"] == "f" else Counter())[key] += 1
    slices: dict[tuple[int, int], list[tuple[float, float]]] = {}
    for event in events:
        if event.get("ph") == "X":
            slices.setdefault((event["pid"], event["tid"]), []).append((event["ts"], event["ts"] + event["dur"]))
    for event in events:  # "bp": "e" binds a flow event to the slice enclosing it on its track
        if event.get("ph") in ("s", "f") and not any(
                lo <= event["ts"] <= hi for lo, hi in slices.get((event["pid"], event["tid"]), [])):
            problems.append(f"flow event {event['ph']} id {event.get('id')}: no slice encloses ts {event['ts']}")
    for key in starts.keys() | finishes.keys():
        if starts[key] != 1 or finishes[key] != 1:
            problems.append(f"flow {key}: {starts[key]} start(s), {finishes[key]} finish(es); expected one each")
    return problems


def flow_pairs(events: list[dict[str, Any]]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(start, finish) of every flow."""
    starts = {e["id"]: e for e in events if e["ph"] == "s"}
    return [(starts[e["id"]], e) for e in events if e["ph"] == "f" and e["id"] in starts]
