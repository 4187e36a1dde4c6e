"""Trace clocks across hosts (`telemetry/trace_clocks.py`): a host's clock offset measured over round
trips with an injected clock, and the trace merge putting that host's events on the driver's clock
(the driver host's events unshifted)."""

from __future__ import annotations

import itertools
import json

import pytest

from stream_rlhf.broker.control.topology import TopicConfig, Topology
from stream_rlhf.telemetry.trace import TraceRecorder
from stream_rlhf.telemetry.trace_clocks import CLOCKS, ClockOffset, HostClocks, measure_offset, read_shifts
from stream_rlhf.telemetry.trace_merge import merge_trace, topic_sources

TOPOLOGY = Topology({
    "prompts": TopicConfig(producers=["prompts"], consumers=["rollout"]),
    "rollout": TopicConfig(producers=["rollout"], consumers=["actor_train"]),
})
HOST_AHEAD_NS = 2_500_000_000
"""The other host's clock runs 2.5 s ahead of the driver's."""


def test_the_offset_is_the_host_reading_minus_the_midpoint_of_the_shortest_round_trip():
    # driver readings in pairs (t0, t2): round trips of 10, 4 and 6 us; the host answers 2.5 s ahead
    # of the midpoint, plus 1 us of one-way asymmetry in the round trip of 4 us
    driver = iter([1_000_000, 1_010_000, 2_000_000, 2_004_000, 3_000_000, 3_006_000])
    host = iter([1_005_000 + HOST_AHEAD_NS, 2_003_000 + HOST_AHEAD_NS, 3_003_000 + HOST_AHEAD_NS])
    offset = measure_offset(lambda: next(host), clock=lambda: next(driver), rounds=3)
    assert offset == ClockOffset(HOST_AHEAD_NS + 1_000, 2_000, 3)
    assert "+2500.001 ms" in offset.describe() and "+- 0.002 ms" in offset.describe()


def test_a_host_on_the_drivers_clock_measures_zero_within_half_its_round_trip():
    ticks = itertools.count(0, 1_000)
    offset = measure_offset(lambda: next(ticks), clock=lambda: next(ticks))  # t1 exactly mid-way
    assert (offset.offset_ns, offset.uncertainty_ns, offset.round_trips) == (0, 1_000, 8)
    with pytest.raises(ValueError, match="rounds=0"):
        measure_offset(lambda: 0, rounds=0)


def step(recorder: TraceRecorder, stage: str, topic: str, start_us: int, dur_us: int) -> None:
    recorder.write({"ph": "X", "name": f"{stage} {topic}".strip(), "cat": "step", "ts": start_us, "dur": dur_us,
                    "args": {"stage": stage, "topic": topic, "iteration": 0, "minibatch": 0, "policy_version": 0,
                             "samples": 4}})


def test_the_merge_shifts_another_hosts_events_by_its_offset_and_the_drivers_not(tmp_path):
    folder = tmp_path / "trace_events"
    driver_side = TraceRecorder(folder, "prompts-0", "rank 0")
    remote = {name: TraceRecorder(folder, f"{name}-0", "rank 0") for name in ("rollout", "actor_train")}
    ahead_us = HOST_AHEAD_NS // 1000
    # one mini-batch, in driver time: prompts 1000..1010, rollout 1020..1120, actor_train 1200..1280;
    # the other host's events carry its own clock, 2.5 s ahead
    step(driver_side, "prompts", "", 1_000, 10)
    step(remote["rollout"], "rollout", "prompts", 1_020 + ahead_us, 100)
    step(remote["actor_train"], "actor_train", "rollout", 1_200 + ahead_us, 80)
    clocks = HostClocks("driver-host")
    clocks.hosts["train-host"] = ClockOffset(HOST_AHEAD_NS, 300_000, 8)
    clocks.files["train-host"] = {r.path.name for r in remote.values()}
    clocks.write(folder)
    assert json.loads((folder / CLOCKS).read_text())["hosts"]["train-host"]["offset_ns"] == HOST_AHEAD_NS
    assert read_shifts(folder) == {r.path.name: -ahead_us for r in remote.values()}
    merged = merge_trace(folder, tmp_path / "trace.json", topic_sources(TOPOLOGY), ["prompts", "rollout",
                                                                                   "actor_train"])
    names = {e["pid"]: e["args"]["name"] for e in merged.events if e.get("name") == "process_name"}
    starts = {names[e["pid"]]: e["ts"] for e in merged.events if e.get("cat") == "step"}
    assert starts == {"prompts-0": 1_000, "rollout-0": 1_020, "actor_train-0": 1_200}
    # the arrows of the mini-batch lead forward in time again: prompts -> rollout -> actor_train
    flows = sorted((e["ts"], e["ph"], names[e["pid"]]) for e in merged.events if e.get("cat") == "flow")
    assert flows == [(1_009, "s", "prompts-0"), (1_020, "f", "rollout-0"), (1_119, "s", "rollout-0"),
                     (1_200, "f", "actor_train-0")]


def test_without_clocks_every_event_keeps_its_timestamp(tmp_path):
    folder = tmp_path / "trace_events"
    step(TraceRecorder(folder, "rollout-0", "rank 0"), "rollout", "prompts", 5_000, 10)
    assert read_shifts(folder) == {}
    merged = merge_trace(folder, tmp_path / "trace.json", topic_sources(TOPOLOGY), ["rollout"])
    assert [e["ts"] for e in merged.events if e.get("cat") == "step"] == [5_000]
