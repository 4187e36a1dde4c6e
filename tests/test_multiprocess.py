"""Real broker and stage processes over real sockets: fan-out, competing consumers, join,
back-pressure, kill -9 of a consumer, of a producer and of the broker, shared-memory cleanup."""

from __future__ import annotations

import os
import signal
import socket
import time
from pathlib import Path

import pytest

from stream_rlhf.broker.control.topology import BrokerConfig, TopicConfig, Topology
from stream_rlhf.broker.payload import shm
from stream_rlhf.broker.payload.host_server import HOST_SERVER_ENV, HostPayloadServer
from stream_rlhf.launch.local import LocalJob
from stream_rlhf.launch.spec import StageFailed, StageSpec
from tests.stages import read_records
from tests.waiting import wait_for

pytestmark = pytest.mark.slow
FAST_HEARTBEAT = {"heartbeat_interval_s": 0.2, "heartbeat_timeout_s": 1.0}


def make_job(topics: dict, stages: dict, prefix: str, **broker) -> LocalJob:
    topology = Topology({name: TopicConfig(**t) for name, t in topics.items()})
    config = BrokerConfig(**{"address": "tcp://127.0.0.1:*", "shm_prefix": prefix, **FAST_HEARTBEAT, **broker})
    specs = {name: StageSpec(f"tests.stages:{cls}", **kw) for name, (cls, kw) in stages.items()}
    return LocalJob(topology, config, specs)


def work_pipeline(n: int, out, prefix: str, workers: int, delay_s: float, prefetch: int = 2,
                  ready_dir: Path | None = None, **broker) -> LocalJob:
    """src -> items -> work (competing instances, y = 2x) -> done -> sink. Given `ready_dir` (an
    empty folder), src publishes only once every work instance is set up."""
    if ready_dir is None:
        src = ("CountingSource", {"kwargs": {"n": n}})
    else:
        src = ("GatedSource", {"kwargs": {"n": n, "ready_dir": str(ready_dir), "readers": workers}})
    return make_job(
        topics={
            "items": {"producers": ["src"], "consumers": ["work"]},
            "done": {"producers": ["work"], "consumers": ["sink"]},
        },
        stages={
            "src": src,
            "work": ("Worker", {"instances": workers, "prefetch": prefetch,
                                "kwargs": {"out_topic": "done", "delay_s": delay_s,
                                           "ready_dir": str(ready_dir) if ready_dir else None}}),
            "sink": ("Sink", {"kwargs": {"path": str(out), "expected": n}}),
        },
        prefix=prefix,
        **broker,
    )


def run_to_end(job: LocalJob, timeout_s: float = 90) -> None:
    job.start()
    try:
        job.wait(timeout_s)
    finally:
        job.stop()


def port_is_free(port: int) -> bool:
    """`port` can be bound again on 127.0.0.1, as libzmq binds it (SO_REUSEADDR)."""
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def test_fan_out_competing_consumers_and_join(tmp_path, shm_prefix):
    n = 12
    out = tmp_path / "sink.jsonl"
    job = make_job(
        topics={
            "items": {"producers": ["src"], "consumers": ["double", "triple"]},
            "doubled": {"producers": ["double"]},
            "tripled": {"producers": ["triple"]},
            "both": {"join": ["items", "doubled", "tripled"], "consumers": ["sink"]},
        },
        stages={
            "src": ("CountingSource", {"kwargs": {"n": n, "minibatches": 4}}),
            "double": ("Worker", {"instances": 2, "kwargs": {"out_topic": "doubled", "delay_s": 0.02, "field": "y2"}}),
            "triple": ("Worker", {"kwargs": {"out_topic": "tripled", "field": "y3"}}),
            "sink": ("Sink", {"kwargs": {"path": str(out), "expected": n}}),
        },
        prefix=shm_prefix,
    )
    run_to_end(job)
    records = read_records(out)
    assert sorted(r["metadata"]["index"] for r in records) == list(range(n))  # each exactly once
    for r in records:
        x = r["fields"]["x"]
        assert r["fields"]["y2"] == [2 * v for v in x] and r["fields"]["y3"] == [2 * v for v in x]
        assert r["minibatch"] == r["metadata"]["index"] % 4
    # joined metadata: the first part (in join order) that has a key wins, so "worker" is double's
    assert {r["metadata"]["worker"] for r in records} <= {"double-0", "double-1"}


def test_competing_consumers_share_the_work(tmp_path, shm_prefix):
    n = 20
    out, ready = tmp_path / "sink.jsonl", tmp_path / "ready"
    ready.mkdir()  # a worker that joined late would get few items
    job = work_pipeline(n, out, shm_prefix, workers=2, delay_s=0.1, prefetch=1, ready_dir=ready)
    run_to_end(job)
    records = read_records(out)
    assert sorted(r["metadata"]["index"] for r in records) == list(range(n))
    per_worker = {w: sum(r["metadata"]["worker"] == w for r in records) for w in ("work-0", "work-1")}
    assert min(per_worker.values()) >= n // 4, per_worker  # both took a real share


def test_slow_consumer_throttles_producer_and_memory_stays_bounded(tmp_path, shm_prefix):
    n, capacity = 40, 3
    out = tmp_path / "sink.jsonl"
    job = make_job(
        topics={"items": {"producers": ["src"], "consumers": ["sink"]}},
        stages={
            "src": ("CountingSource", {"kwargs": {"n": n, "size": 65536}}),
            "sink": ("Sink", {"prefetch": 1, "kwargs": {"path": str(out), "expected": n, "delay_s": 0.05}}),
        },
        prefix=shm_prefix,
        queue_capacity=capacity,
    )
    job.start()
    peak = 0
    try:
        deadline = time.monotonic() + 90
        while any(p.is_alive() for p in job.processes.values()) and time.monotonic() < deadline:
            peak = max(peak, len(shm.list_segments(shm_prefix)))
            time.sleep(0.005)
        job.wait(5)
    finally:
        job.stop()
    assert len(read_records(out)) == n
    # queued (capacity) + delivered ahead (prefetch 1) + being processed + one being published
    assert 0 < peak <= capacity + 3, peak


def test_kill_9_consumer_mid_handle_redelivers_and_output_has_every_item_once(tmp_path, shm_prefix):
    n = 30
    out = tmp_path / "sink.jsonl"
    job = work_pipeline(n, out, shm_prefix, workers=2, delay_s=0.15)

    def work_0_is_busy() -> bool:  # a work-0 that joined late would hold nothing to redeliver
        records = read_records(out)
        return len(records) >= 4 and any(r["metadata"]["worker"] == "work-0" for r in records)

    job.start()
    try:
        wait_for(work_0_is_busy, 60, "first outputs, one of them from work-0")
        victim = job.processes["work-0"]
        os.kill(victim.pid, signal.SIGKILL)  # in the middle of a 150 ms step, with prefetched handles
        with job.client() as client:
            wait_for(lambda: client.stats().get("redelivered", 0) > 0, 10, "redelivery")
        job.processes.pop("work-0")
        job.wait(90)
    finally:
        job.stop()
    records = read_records(out)
    indices = sorted(r["metadata"]["index"] for r in records)
    assert indices == list(range(n)), "every item exactly once"


def test_clean_shutdown_leaves_no_shared_memory(tmp_path, shm_prefix):
    out = tmp_path / "sink.jsonl"
    job = make_job(
        topics={"items": {"producers": ["src"], "consumers": ["sink"]}},
        stages={
            "src": ("CountingSource", {"kwargs": {"n": 10_000, "size": 1024}}),
            "sink": ("Sink", {"kwargs": {"path": str(out), "expected": 10_000, "delay_s": 0.01}}),
        },
        prefix=shm_prefix,
    )
    job.start()
    try:
        wait_for(lambda: len(read_records(out)) >= 5, 60, "traffic")
        assert shm.list_segments(shm_prefix)  # payloads are in flight
    finally:
        job.stop()  # shutdown mid-stream: stages drain, the broker unlinks the rest
    assert shm.list_segments(shm_prefix) == []


@pytest.mark.parametrize("host", ["the broker's", "another"])
def test_killed_producer_segments_are_reclaimed(tmp_path, shm_prefix, monkeypatch, host):
    """On another host (the stages' host id differs from the broker's) the broker cannot unlink
    them itself: it asks the payload server their Hellos named (the Ray launcher runs one a host)."""
    out = tmp_path / "sink.jsonl"
    job = make_job(
        topics={"items": {"producers": ["src"], "consumers": ["sink"]}},
        stages={
            "src": ("CountingSource", {"kwargs": {"n": 10_000, "size": 1024}}),
            "sink": ("Sink", {"prefetch": 1, "kwargs": {"path": str(out), "expected": 10_000, "delay_s": 0.05}}),
        },
        prefix=shm_prefix,
    )
    host_server = HostPayloadServer(shm_prefix, "127.0.0.1", None) if host == "another" else None
    job.start_broker()
    if host_server is not None:
        monkeypatch.setenv("STREAM_RLHF_HOST_ID", "another-host")
        monkeypatch.setenv(HOST_SERVER_ENV, host_server.endpoint)
    try:
        for stage in job.stages:
            job.start_instance(stage, 0)
        wait_for(lambda: len(read_records(out)) >= 3, 60, "traffic")
        src = job.processes.pop("src-0")
        os.kill(src.pid, signal.SIGKILL)
        src.join(5)
        assert shm.list_segments(shm_prefix)  # the dead producer's payloads outlive it
        # the sink keeps consuming what was published; once the broker sees the producer dead
        # (missed heartbeats) it unlinks every segment of it that no live handle still needs
        with job.client() as client:
            wait_for(lambda: client.stats().get("inflight_handles", 1) == 0, 30, "queue to drain")
        wait_for(lambda: shm.list_segments(shm_prefix) == [], 10, "segments to be reclaimed")
        with job.client() as client:  # a new one: the broker drops a client silent past heartbeat_timeout_s
            stats = client.stats()
        if host_server is None:
            assert stats["segments_reclaimed"] > 0 and stats["segments_reclaimed_remote"] == 0
        else:
            assert stats["segments_reclaimed"] == 0 and stats["segments_reclaimed_remote"] > 0
            assert host_server.counters["payload.reclaimed"] == stats["segments_reclaimed_remote"]
    finally:
        job.stop()
        if host_server is not None:
            host_server.stop()
    assert shm.list_segments(shm_prefix) == []


def test_a_step_stuck_outside_gives_up_at_shutdown_and_the_instance_exits_cleanly(tmp_path, shm_prefix, caplog):
    """A step waiting on something that never answers (a hung engine) watches StageContext.stopping:
    the job's shutdown ends it, with exit code 0, and the launcher never has to terminate it."""
    job = make_job(
        topics={"items": {"producers": ["src"], "consumers": ["stuck"]}},
        stages={
            "src": ("CountingSource", {"kwargs": {"n": 3}}),
            "stuck": ("StuckWorker", {"kwargs": {"ready_dir": str(tmp_path)}}),
        },
        prefix=shm_prefix,
    )
    job.start()
    try:
        wait_for(lambda: (tmp_path / "started").exists(), 60, "the stuck step")
    finally:
        job.stop()
    assert job.processes["stuck-0"].exitcode == 0
    assert "ignored shutdown" not in caplog.text  # what the launcher logs before it sends SIGTERM


def test_broker_killed_and_restarted_recovers_from_journal(tmp_path, shm_prefix, free_port):
    n = 30
    out = tmp_path / "sink.jsonl"
    job = work_pipeline(
        n, out, shm_prefix, workers=1, delay_s=0.05,
        address=f"tcp://127.0.0.1:{free_port}", journal=str(tmp_path / "broker.journal"),
    )
    job.start()
    try:
        wait_for(lambda: len(read_records(out)) >= 5, 60, "first outputs")
        os.kill(job.broker_process.pid, signal.SIGKILL)
        job.broker_process.join(5)
        wait_for(lambda: port_is_free(free_port), 10, f"port {free_port} of the killed broker to be free")
        job.start_broker()
        job.wait(90)
    finally:
        job.stop()
    indices = sorted(r["metadata"]["index"] for r in read_records(out))
    assert indices == list(range(n)), "every item exactly once across the broker restart"


def test_a_dead_broker_fails_the_job_naming_it(tmp_path, shm_prefix):
    """Stages keep saying hello to a broker that is gone; the launcher notices it, not a timeout."""
    job = work_pipeline(1000, tmp_path / "sink.jsonl", shm_prefix, workers=1, delay_s=0.05)
    job.start()
    try:
        wait_for(lambda: len(read_records(tmp_path / "sink.jsonl")) >= 2, 60, "first outputs")
        os.kill(job.broker_process.pid, signal.SIGKILL)
        with pytest.raises(StageFailed, match=r"the broker exited \(code -9\) while 3 stage process\(es\) ran"):
            job.wait(600)
    finally:
        job.stop()
    assert not any(p.is_alive() for p in job.processes.values())


def test_a_dropped_handle_fails_a_job_that_needs_every_handle(tmp_path, shm_prefix):
    """Handles the broker gives up on (here: their payloads were unlinked before the consumer read
    them) would leave a job that waits for them hanging until its timeout; the watch fails it."""
    out = tmp_path / "out.jsonl"
    job = make_job(
        topics={"items": {"producers": ["src"], "consumers": ["work"]},
                "done": {"producers": ["work"], "consumers": ["sink"]}},
        stages={"src": ("CountingSource", {"kwargs": {"n": 4}}),
                "work": ("PayloadLosingWorker", {"kwargs": {"out_topic": "done", "prefix": shm_prefix}}),
                "sink": ("Sink", {"kwargs": {"path": str(out), "expected": 4}})},
        prefix=shm_prefix,
    )
    job.start()
    try:  # the watch's message, not the wait's timeout
        with pytest.raises(StageFailed, match=r"the broker dropped [1-4] handle\(s\) \(rejected [1-4]; "):
            job.wait(60, watch=job.fail_on_dropped_handles, watch_every_s=0.5)
    finally:
        job.stop()
    assert not read_records(out)


def test_the_setup_error_is_the_one_a_failed_stage_exits_with(tmp_path, shm_prefix, capfd):
    """A stage whose setup raises and whose close() then fails for want of what setup did not
    build: the process exits with the setup's error (close's is logged), not with close's."""
    job = make_job(topics={"items": {"producers": ["src"], "consumers": ["work"]}},
                   stages={"src": ("CountingSource", {"kwargs": {"n": 2}}), "work": ("SetupFails", {})},
                   prefix=shm_prefix)
    job.start()
    try:
        with pytest.raises(StageFailed, match=r"work-0"):
            job.wait(60)
    finally:
        job.stop()
    err = capfd.readouterr().err
    assert "close() raised after a setup that did not finish" in err
    last_error = [line for line in err.splitlines() if line.startswith(("RuntimeError", "AttributeError"))][-1]
    assert last_error == "RuntimeError: no model at /nowhere"
