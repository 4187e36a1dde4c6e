"""A stage with several inputs in flight (`Stage.inputs_in_flight()` > 1) through a real broker and
real runners (sockets, shared memory; each in a thread of this process), and through the in-process bus.

    source ─► items ─► work (Overlapper: 2 inputs in flight, ends them out of order) ─► done ─► collect
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator

import pytest
import torch

from stream_rlhf.broker.control.client import ControlClient
from stream_rlhf.broker.control.server import BrokerServer
from stream_rlhf.broker.control.topology import BrokerConfig, TopicConfig, Topology
from stream_rlhf.broker.runtime.in_flight import inputs_in_flight
from stream_rlhf.broker.runtime.inprocess import InProcessBus
from stream_rlhf.broker.runtime.runner import RunnerState, StageRunner
from stream_rlhf.stage import Batch, Output, Stage
from stream_rlhf.telemetry import trace
from tests.stages import CountingSource
from tests.waiting import wait_for

TOPOLOGY = Topology({
    "items": TopicConfig(producers=["source"], consumers=["work"]),
    "done": TopicConfig(producers=["work"], consumers=["collect"]),
})
MINIBATCHES = 2  # the source's items i are iteration i // 2, mini-batch i % 2


class Overlapper(Stage):
    """Works on 2 inputs at once: holds an input until a second one is begun (or it waited `patience`
    advances alone), then ends the newer one first and the older one at the next advance. Sends
    weights_ready at its first begin and ends nothing before it heard of them (on_weights). With
    `fail_when_full`, an advance with 2 inputs in flight raises; with `release` clear, nothing ends."""

    def __init__(self, fail_when_full: bool = False, patience: int = 5_000, release: threading.Event | None = None):
        self.fail_when_full, self.patience = fail_when_full, patience
        self.release = release or threading.Event()
        if release is None:
            self.release.set()
        self.in_flight: list[Batch] = []  # begin order
        self.ending: list[Batch] = []  # ends at the next advance
        self.begun_ids: list[str] = []
        self.ended_ids: list[str] = []
        self.max_in_flight = 0
        self.in_flight_at_weights: list[int] = []  # inputs in flight at each on_weights
        self.alone_for = 0  # advances with one input in flight

    def inputs_in_flight(self) -> int:
        return 2

    def begin(self, batch: Batch) -> None:
        self.in_flight.append(batch)
        self.begun_ids.append(batch.handle.id)
        self.max_in_flight = max(self.max_in_flight, len(self.in_flight))
        if len(self.begun_ids) == 1:
            self.ctx.send_control("weights_ready", 1)

    def on_weights(self, version: int) -> None:
        self.in_flight_at_weights.append(len(self.in_flight))

    def advance(self) -> list[tuple[Batch, list[Output]]]:
        time.sleep(0.001)  # a decode step
        if self.fail_when_full and len(self.in_flight) == 2:
            raise RuntimeError("toy engine failed")
        if not self.in_flight_at_weights or not self.release.is_set():
            return []
        if not self.ending:
            self.alone_for = self.alone_for + 1 if len(self.in_flight) == 1 else 0
            if len(self.in_flight) == 2:
                self.ending = [self.in_flight[1], self.in_flight[0]]  # out of order: the newer first
            elif self.alone_for >= self.patience:
                self.ending = [self.in_flight[0]]
            else:
                return []
        batch = self.ending.pop(0)
        self.in_flight.remove(batch)
        self.ended_ids.append(batch.handle.id)
        index = batch.metadata["index"]
        return [(batch, [Output("done", {"y": batch.tensors["x"] * 2}, batch.num_samples, metadata={"index": index})])]


class Collect(Stage):
    """Keeps (iteration, mini-batch, index, y) of every handle on `done`."""

    def __init__(self):
        self.records: list[tuple[int, int, int, list[float]]] = []

    def step(self, batch: Batch | None) -> list[Output]:
        self.records.append((batch.iteration, batch.minibatch, batch.metadata["index"], batch.tensors["y"].tolist()))
        return []


def expected(n: int) -> list[tuple[int, int, int, list[float]]]:
    return [(i // MINIBATCHES, i % MINIBATCHES, i, (2 * (torch.arange(4.0) + i)).tolist()) for i in range(n)]


class Job:
    """A broker and stage runners, each in a thread of this process."""

    def __init__(self, prefix: str):
        self.prefix = prefix
        self.server = BrokerServer(TOPOLOGY, BrokerConfig(address="tcp://127.0.0.1:*", shm_prefix=prefix),
                                   shutdown_grace_s=5.0)
        self.broker = threading.Thread(target=self.server.serve, daemon=True)
        self.broker.start()
        self.runs: list[tuple[StageRunner, threading.Thread, list[BaseException]]] = []

    def start(self, stage: Stage, name: str, instance: int = 0, drain_timeout_s: float = 30.0) -> StageRunner:
        runner = StageRunner(stage, name, f"{name}-{instance}", self.server.address, shm_prefix=self.prefix,
                             drain_timeout_s=drain_timeout_s)
        errors: list[BaseException] = []

        def run() -> None:
            try:
                runner.run()
            except BaseException as exc:  # noqa: BLE001 - the test reads it
                errors.append(exc)

        thread = threading.Thread(target=run, name=runner.instance_id, daemon=True)
        thread.start()
        self.runs.append((runner, thread, errors))
        return runner

    def errors(self, runner: StageRunner) -> list[BaseException]:
        return next(errors for r, _, errors in self.runs if r is runner)

    def stopped(self, runner: StageRunner) -> bool:
        return not next(thread for r, thread, _ in self.runs if r is runner).is_alive()

    def stop(self) -> None:
        self.server.request_stop()  # every stage is told to shut down; the broker stops once they left
        self.broker.join(15)
        for runner, thread, _ in self.runs:
            if thread.is_alive():
                runner.request_stop()
                runner.request_stop()
            thread.join(10)
        assert not self.broker.is_alive() and not any(thread.is_alive() for _, thread, _ in self.runs)


@contextlib.contextmanager
def job(prefix: str) -> Iterator[Job]:
    running = Job(prefix)
    try:
        yield running
    finally:
        running.stop()


def test_two_inputs_in_flight_end_out_of_order_and_every_output_is_published_once(shm_prefix, tmp_path):
    n = 6
    work, collect = Overlapper(), Collect()
    trace.start(tmp_path, "test", "main")
    try:
        with job(shm_prefix) as j:
            runner = j.start(work, "work")
            j.start(collect, "collect")
            j.start(CountingSource(n, minibatches=MINIBATCHES), "source")
            wait_for(lambda: len(collect.records) >= n, 30, f"{n} outputs on 'done'")
    finally:
        trace.stop()
    assert sorted(collect.records) == expected(n)  # each once, with its input's iteration and mini-batch
    assert work.max_in_flight == 2
    assert work.ended_ids != work.begun_ids and sorted(work.ended_ids) == sorted(work.begun_ids)
    assert work.in_flight_at_weights[0] >= 1  # weights_ready reached on_weights between advances
    assert runner.host.counters["steps"] == n and not j.errors(runner)
    events = [json.loads(line) for path in tmp_path.glob("*.jsonl") for line in path.read_text().splitlines()]
    steps = [e for e in events if e.get("name") == "work items"]  # one per input, on its in-flight position's track
    assert len(steps) == n and {e["tid"] for e in steps} == {"main/input 0", "main/input 1"}


def test_inputs_still_in_flight_after_drain_timeout_go_back_to_the_broker(shm_prefix):
    work = Overlapper(release=threading.Event())  # never ends an input
    with job(shm_prefix) as j:
        runner = j.start(work, "work", drain_timeout_s=0.2)
        j.start(CountingSource(4, minibatches=MINIBATCHES), "source")
        wait_for(lambda: work.max_in_flight == 2, 30, "2 inputs in flight")
        runner.request_stop()  # as a first Ctrl-C: drain
        wait_for(lambda: j.stopped(runner), 30, "work to stop after drain_timeout_s")
        wait_for(lambda: j.server.core.stats["nacked"] >= 2, 30, "both inputs nacked back")
    assert not work.ended_ids and runner.host.counters["steps"] == 0 and not j.errors(runner)


def test_a_failed_advance_gives_both_inputs_back_to_another_instance(shm_prefix):
    n = 4
    failing, restarted, collect = Overlapper(fail_when_full=True), Overlapper(), Collect()
    with job(shm_prefix) as j:
        first = j.start(failing, "work")
        j.start(collect, "collect")
        j.start(CountingSource(n, minibatches=MINIBATCHES), "source")
        wait_for(lambda: j.stopped(first), 30, "the failing instance to stop")
        second = j.start(restarted, "work", instance=1)
        wait_for(lambda: len(collect.records) >= n, 30, f"{n} outputs on 'done'")
        nacked = j.server.core.stats["nacked"]
    assert [str(e) for e in j.errors(first)] == ["toy engine failed"]
    assert len(failing.begun_ids) == 2 and not failing.ended_ids
    assert set(failing.begun_ids) <= set(restarted.begun_ids)  # both redelivered
    assert nacked >= 2
    assert sorted(collect.records) == expected(n)  # nothing lost, nothing twice
    assert second.host.counters["steps"] == n


def test_a_drain_finishes_the_inputs_in_flight_before_the_instance_stops(shm_prefix):
    n = 4
    release = threading.Event()
    work, collect = Overlapper(release=release), Collect()
    with job(shm_prefix) as j:
        runner = j.start(work, "work")
        j.start(collect, "collect")
        j.start(CountingSource(n, minibatches=MINIBATCHES), "source")
        wait_for(lambda: work.max_in_flight == 2 and work.in_flight_at_weights, 30, "2 inputs in flight")
        with ControlClient(j.server.address) as client:
            client.control("drain", "work")
        wait_for(lambda: runner.state is not RunnerState.RUNNING, 30, "work to drain")
        assert not j.stopped(runner)  # its inputs in flight hold it
        release.set()
        wait_for(lambda: j.stopped(runner), 30, "work to stop once drained")
        wait_for(lambda: len(collect.records) >= 2, 30, "the 2 outputs of the inputs in flight")
    assert sorted(work.ended_ids) == sorted(work.begun_ids) and len(work.begun_ids) == 2
    indices = sorted(record[2] for record in collect.records)
    assert indices == [0, 1] and not j.errors(runner)


def test_the_in_process_bus_runs_it_one_input_at_a_time_to_the_same_outputs():
    n = 6
    work, collect = Overlapper(patience=3), Collect()
    bus = InProcessBus(TOPOLOGY)
    bus.add("source", CountingSource(n, minibatches=MINIBATCHES))
    bus.add("work", work)
    bus.add("collect", collect)
    stats = bus.run()
    assert sorted(collect.records) == expected(n)
    assert work.max_in_flight == 1 and work.in_flight_at_weights[0] == 1
    assert stats["inflight_handles"] == 0 and bus.transport.held() == 0


def test_several_inputs_in_flight_are_refused_for_an_instance_of_several_ranks():
    with pytest.raises(ValueError, match=r"work: inputs_in_flight\(\)=2 is not supported for an instance of 2 ranks"):
        inputs_in_flight(Overlapper(), "work", ranks=2)
    assert inputs_in_flight(Overlapper(), "work", ranks=1) == 2
