"""Per-process trace files (`telemetry/trace.py`) merged into one valid Trace Event JSON file
(`telemetry/trace_merge.py`), with named tracks, one mini-batch's flow arrows and counters; and
a stage host traces its steps through the real recorder."""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch

from stream_rlhf.broker.control.topology import BrokerConfig, TopicConfig, Topology
from stream_rlhf.broker.runtime.inprocess import InProcessBus
from stream_rlhf.stage import Output, Stage
from stream_rlhf.telemetry import trace
from stream_rlhf.telemetry.trace import TraceRecorder
from stream_rlhf.telemetry.trace_merge import merge_trace, topic_sources
from tests.trace_rules import check_trace, flow_pairs

TOPOLOGY = Topology({
    "prompts": TopicConfig(producers=["prompts"], consumers=["rollout"]),
    "rollout": TopicConfig(producers=["rollout"], consumers=["ref_forward"]),
    "ref_logp": TopicConfig(producers=["ref_forward"]),
    "experience": TopicConfig(join=["rollout", "ref_logp"], consumers=["actor_train"]),
})
ORDER = ["prompts", "rollout", "ref_forward", "actor_train"]


@pytest.fixture(autouse=True)
def no_trace_left_running():
    yield
    trace.stop()


def step(recorder: TraceRecorder, stage: str, topic: str, start_us: int, dur_us: int, minibatch: int = 0) -> None:
    recorder.write({"ph": "X", "name": f"{stage} {topic}".strip(), "cat": "step", "ts": start_us, "dur": dur_us,
                    "args": {"stage": stage, "topic": topic, "iteration": 0, "minibatch": minibatch,
                             "policy_version": 0, "samples": 4}})


def test_sources_expand_a_join_into_its_parts_producers():
    assert topic_sources(TOPOLOGY) == {"prompts": ["prompts"], "rollout": ["rollout"], "ref_logp": ["ref_forward"],
                                       "experience": ["ref_forward", "rollout"]}


def test_merge_names_tracks_links_a_minibatch_and_survives_a_torn_line(tmp_path):
    folder = tmp_path / "trace_events"
    recorders = {name: TraceRecorder(folder, f"{name}-0", "rank 0") for name in ORDER}
    TraceRecorder(folder, "actor_train-0", "rank 1")  # a rank that recorded nothing but its start
    broker = TraceRecorder(folder, "broker", "broker")
    step(recorders["prompts"], "prompts", "", 1_000, 10)
    step(recorders["rollout"], "rollout", "prompts", 1_020, 100)
    step(recorders["ref_forward"], "ref_forward", "rollout", 1_130, 50)
    step(recorders["actor_train"], "actor_train", "experience", 1_200, 80)
    step(recorders["rollout"], "rollout", "prompts", 2_000, 100, minibatch=1)  # no prompts step of mini-batch 1
    broker.write({"ph": "C", "name": "queue rollout>ref_forward", "ts": 1_125, "args": {"value": 1}})
    thread = threading.Thread(target=lambda: recorders["actor_train"].write(
        {"ph": "X", "name": "weights send", "cat": "weights", "ts": 1_300, "dur": 5, "args": {}}), name="weight-sync")
    thread.start()
    thread.join()
    for recorder in [*recorders.values(), broker]:
        recorder.close()
    with (folder / "killed.rank_0.1.jsonl").open("w") as f:  # a process killed mid-write
        f.write('{"ph":"M","name":"thread_name","args":{"name":"rank 0"},"pid":"killed","tid":"rank 0"}\n{"ph":"X","na')
    metrics = [{"iteration": 0, "staleness_mean": 0.5, "staleness_max": 1}]

    merged = merge_trace(folder, tmp_path / "trace.json", topic_sources(TOPOLOGY), ORDER, metrics)

    data = json.loads((tmp_path / "trace.json").read_text())
    assert check_trace(data) == []
    assert data["traceEvents"] == merged.events
    assert (merged.lines_skipped, data["otherData"]["lines_skipped"]) == (1, 1)
    names = {e["pid"]: e["args"]["name"] for e in merged.events if e["name"] == "process_name"}
    assert list(names.values()) == [*(f"{s}-0" for s in ORDER), "killed", "broker"]  # dataflow order, broker last
    pid = {name: number for number, name in names.items()}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in merged.events if e["name"] == "thread_name"}
    assert threads[(pid["actor_train-0"], 0)] == "rank 0"
    assert threads[(pid["actor_train-0"], 1)] == "rank 1"
    assert threads[(pid["actor_train-0"], 1000)] == "rank 0/weight-sync"
    arrows = sorted((names[s["pid"]], names[f["pid"]]) for s, f in flow_pairs(merged.events))
    assert arrows == [("prompts-0", "rollout-0"), ("ref_forward-0", "actor_train-0"),
                      ("rollout-0", "actor_train-0"), ("rollout-0", "ref_forward-0")]
    counters = {e["name"]: (names[e["pid"]], e["args"]) for e in merged.events if e["ph"] == "C"}
    assert counters == {"queue rollout>ref_forward": ("broker", {"value": 1}),
                        "staleness": ("actor_train-0", {"mean": 0.5, "max": 1})}


class Source(Stage):
    def __init__(self):
        self.left = 2

    def setup(self, ctx) -> None:
        pass

    def step(self, batch):
        if not self.left:
            return None
        self.left -= 1
        return [Output("numbers", {"x": torch.arange(4)}, num_samples=4, iteration=0, minibatch=1 - self.left)]

    def on_weights(self, version: int) -> None:
        pass

    def close(self) -> None:
        pass


class Double(Source):
    def step(self, batch):
        time.sleep(0.01)
        return [Output("doubled", {"x": batch.tensors["x"] * 2}, num_samples=batch.handle.num_samples)]


class Sink(Source):
    def step(self, batch):
        return []


def test_a_stage_host_traces_its_steps_fetches_and_publishes(tmp_path):
    topology = Topology({"numbers": TopicConfig(producers=["source"], consumers=["double"]),
                         "doubled": TopicConfig(producers=["double"], consumers=["sink"])})
    trace.start(tmp_path / "events", "all-0", "rank 0")  # the in-process bus runs every stage on this thread
    bus = InProcessBus(topology, BrokerConfig())
    for name, stage in {"source": Source(), "double": Double(), "sink": Sink()}.items():
        bus.add(name, stage)
    bus.run()
    trace.stop()
    merged = merge_trace(tmp_path / "events", tmp_path / "trace.json", topic_sources(topology), ["source", "double"])
    assert check_trace(json.loads((tmp_path / "trace.json").read_text())) == []
    steps = [(e["name"], e["args"]["iteration"], e["args"]["minibatch"], e["args"]["samples"])
             for e in merged.events if e["ph"] == "X" and e["cat"] == "step"]
    assert sorted(steps) == [("double numbers", 0, 0, 4), ("double numbers", 0, 1, 4), ("sink doubled", 0, 0, 4),
                             ("sink doubled", 0, 1, 4), ("source", 0, 0, 4), ("source", 0, 1, 4)]
    fetches = [e for e in merged.events if e["ph"] == "X" and e["name"] == "fetch"]
    assert sorted(e["args"]["topic"] for e in fetches) == ["doubled", "doubled", "numbers", "numbers"]
    assert sum(e["name"] == "publish" for e in merged.events) == 4  # source and double, each mini-batch
    assert len(flow_pairs(merged.events)) == 4  # source -> double -> sink, for both mini-batches
