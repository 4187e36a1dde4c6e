"""Broker benchmark: handle throughput, hop latency and payload bandwidth, next to their baselines.

Every figure comes from separate processes (multiprocessing spawn) on this host:

    handles/s      a source stage -> BrokerServer -> sink stage, as real StageRunner processes
                   started by LocalJob over TCP loopback, pipelined with a credit window of
                   queue_capacity 64 and prefetch 16. The source publishes as fast as credit allows
                   for a warm-up, then for a timed span; the figure is the rate at which the
                   handles of the timed span reach the sinks' step(), with 1 and with 4
                   competing sink instances. Each handle carries one tiny tensor (4 float32) in
                   shared memory (a slot of the producer's small-payload arena).
    raw msgs/s     baseline: a plain pyzmq DEALER -> ROUTER echo between two processes over TCP
                   loopback, 128 messages in flight, each the bytes of an encoded Deliver of such a
                   handle. One echo crosses two socket hops, as a handle does (producer -> broker ->
                   consumer). The same echo, one message at a time, is the baseline of the hop
                   latency (median round trip).
    hop latency    the 1-consumer run goes on with one handle in flight at a time (the source
                   waits until the sink has the previous one, then 1 ms for acks and credit to
                   settle), a warm-up and a timed span again: one-way time from the
                   source's step() creating the output to the sink's step() receiving it
                   (payload put, publish, broker, delivery, payload map), stamped with
                   time.monotonic_ns() (CLOCK_MONOTONIC, one clock for every process of the host)
                   in the handle's metadata.
    shm / tcp GB/s a 64 MB tensor from a producer process to a consumer process through
                   ShmTransport (same-host shared memory; prefer="tcp": the producer's payload
                   server over TCP loopback), from the producer's put() until the consumer's get()
                   returned the tensor; 64e6 bytes / median time.
    memcpy GB/s    baseline: numpy copy of the same 64 MB into a preallocated array, median.

Run from the repository root:

    .venv/bin/python bench/broker.py            # full run (about a minute): the table
    .venv/bin/python bench/broker.py --quick    # smoke run, well under a minute
    .venv/bin/python bench/broker.py --json     # the table, then one JSON object as the last line

Results and the machine they were measured on: bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import time
import uuid
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Event
from typing import Literal, TypedDict

import numpy as np
import torch
import zmq

from stream_rlhf.broker.control.messages import Deliver, Handle, decode, encode
from stream_rlhf.broker.control.topology import BrokerConfig, TopicConfig, Topology
from stream_rlhf.broker.payload import shm
from stream_rlhf.broker.payload.transport import ShmTransport
from stream_rlhf.launch.local import LocalJob
from stream_rlhf.launch.spec import StageSpec
from stream_rlhf.stage import Batch, Output, Stage

TOPIC = "bench"
PAYLOAD_BYTES = 64_000_000
TIMEOUT_S = 120.0
PREFETCH = 16  # deliveries a sink may have ahead: a window that keeps the pipe full
QUEUE_CAPACITY = 64  # handles queued per consumer stage before the source gets no credit
SETTLE_S = 0.001  # latency run: idle time before each handle, so acks and credit have settled
RAW_WINDOW = 128


@dataclass(frozen=True)
class Settings:
    warmup_s: float
    """Seconds at the start of each phase of a stage run whose handles are not timed."""
    timed_s: float
    """Seconds of timed handles per phase (pipelined throughput, paced latency)."""
    raw_messages: int
    """Messages echoed by the pyzmq baseline (after as many warm-up messages as the window)."""
    raw_pings: int
    """Round trips of one message at a time timed by the pyzmq baseline."""
    payload_repeats: int
    """Timed 64 MB moves per transport (after one untimed), and timed memcpys."""


FULL = Settings(warmup_s=1.0, timed_s=5.0, raw_messages=400_000, raw_pings=2_000, payload_repeats=9)
QUICK = Settings(warmup_s=0.2, timed_s=0.5, raw_messages=20_000, raw_pings=200, payload_repeats=3)


# ---- stages (loaded by LocalJob in the spawned stage processes) -----------------------------

Phase = Literal["pipelined", "paced"]


class Report(TypedDict):
    instance: str
    timed: int
    """Source: timed handles published. Sink: timed handles received (every phase)."""
    pipelined: int
    """Sink: timed handles of the pipelined phase received, the first at first_ns, the last at last_ns."""
    first_ns: int
    last_ns: int
    hops_ns: list[int]
    """Sink: source step() -> sink step() of each timed handle of the paced phase."""


class Source(Stage):
    """Publishes handles with one tiny tensor, phase after phase, each warmup_s + timed_s long:
    "pipelined" as fast as credit allows; "paced" one at a time: waits for a sink to have the
    previous handle (`turn`), then SETTLE_S. Metadata: phase, timed or not, send time."""

    def __init__(self, reports: Queue, turn: Event, phases: list[Phase], warmup_s: float, timed_s: float):
        self.reports = reports
        self.turn = turn
        self.phases = phases
        self.warmup_s = warmup_s
        self.timed_s = timed_s
        self.tensors = {"x": torch.zeros(4)}  # (4,)
        self.started = 0.0
        self.sent = 0
        self.timed = 0

    def step(self, batch: Batch | None) -> list[Output] | None:
        self.started = self.started or time.monotonic()
        index, elapsed = divmod(time.monotonic() - self.started, self.warmup_s + self.timed_s)
        if index >= len(self.phases):
            return None
        phase = self.phases[int(index)]
        if phase == "paced" and self.sent:
            self._wait_turn()
        timed = elapsed >= self.warmup_s
        self.timed += timed
        seq, self.sent = self.sent, self.sent + 1
        metadata = {"phase": phase, "timed": timed, "sent_ns": time.monotonic_ns()}
        return [Output(TOPIC, self.tensors, 1, iteration=seq, minibatch=0, policy_version=0, metadata=metadata)]

    def _wait_turn(self) -> None:
        if not self.turn.wait(TIMEOUT_S):
            raise TimeoutError(f"no sink received handle {self.sent - 1} in {TIMEOUT_S}s")
        self.turn.clear()
        time.sleep(SETTLE_S)

    def close(self) -> None:
        self.reports.put(Report(
            instance=self.ctx.instance_id, timed=self.timed, pipelined=0, first_ns=0, last_ns=0, hops_ns=[],
        ))


class Sink(Stage):
    """Counts the timed handles of the pipelined phase, keeps the hop times of the paced phase;
    reports when it stops."""

    def __init__(self, reports: Queue, turn: Event):
        self.reports = reports
        self.turn = turn
        self.pipelined = 0
        self.first_ns = self.last_ns = 0
        self.hops_ns: list[int] = []

    def step(self, batch: Batch | None) -> list[Output]:
        now = time.monotonic_ns()
        if batch.metadata["timed"] and batch.metadata["phase"] == "pipelined":
            self.pipelined += 1
            self.first_ns = self.first_ns or now
            self.last_ns = now
        elif batch.metadata["timed"]:
            self.hops_ns.append(now - batch.metadata["sent_ns"])
        self.turn.set()
        return []

    def close(self) -> None:
        self.reports.put(Report(
            instance=self.ctx.instance_id, timed=self.pipelined + len(self.hops_ns), pipelined=self.pipelined,
            first_ns=self.first_ns, last_ns=self.last_ns, hops_ns=self.hops_ns,
        ))


def class_path(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


# ---- the real path: LocalJob with a BrokerServer and StageRunner processes --------------------


def run_job(prefix: str, settings: Settings, sinks: int, phases: list[Phase]) -> list[Report]:
    """Source -> broker -> `sinks` sink instances until the source is done and every handle it
    published was acked; returns the sinks' reports (after checking that none was lost)."""
    ctx = mp.get_context("spawn")
    reports = ctx.Queue()
    turn = ctx.Event()
    timing = {"phases": phases, "warmup_s": settings.warmup_s, "timed_s": settings.timed_s}
    topology = Topology({TOPIC: TopicConfig(producers=["source"], consumers=["sink"])})
    config = BrokerConfig(address="tcp://127.0.0.1:*", shm_prefix=prefix, queue_capacity=QUEUE_CAPACITY)
    job = LocalJob(topology, config, {
        "source": StageSpec(class_path(Source), kwargs={"reports": reports, "turn": turn, **timing}),
        "sink": StageSpec(class_path(Sink), instances=sinks, prefetch=PREFETCH,
                          kwargs={"reports": reports, "turn": turn}),
    })
    try:
        job.start()
        source = job.processes["source-0"]
        source.join(len(phases) * (settings.warmup_s + settings.timed_s) + TIMEOUT_S)  # stops once all is released
        if source.exitcode != 0:
            raise RuntimeError(f"source stage: exit code {source.exitcode} (None: still running)")
        with job.client() as client:
            client.control("shutdown")
        received = [reports.get(timeout=TIMEOUT_S) for _ in range(sinks + 1)]
        for process in job.processes.values():
            process.join(TIMEOUT_S)  # gone before job.stop(), which would send a second shutdown
    finally:
        job.stop()
        assert_no_segments(prefix)
    published = sum(r["timed"] for r in received if r["instance"].startswith("source"))
    sink_reports = [r for r in received if r["instance"].startswith("sink")]
    arrived = sum(r["timed"] for r in sink_reports)
    if arrived != published:
        raise RuntimeError(f"sinks received {arrived} timed handles, the source published {published}")
    return sink_reports


def handles_per_s(reports: list[Report]) -> float:
    """Timed pipelined handles per second, from the first arrival at any sink to the last."""
    reports = [r for r in reports if r["pipelined"]]
    span_ns = max(r["last_ns"] for r in reports) - min(r["first_ns"] for r in reports)
    return (sum(r["pipelined"] for r in reports) - 1) / span_ns * 1e9


def hop_percentiles_us(reports: list[Report]) -> tuple[float, float]:
    hops_ns = [h for r in reports for h in r["hops_ns"]]
    p50, p99 = np.percentile(hops_ns, [50, 99])
    return p50 / 1e3, p99 / 1e3


def deliver_bytes(prefix: str) -> bytes:
    """An encoded Deliver of a handle as the source publishes it, with a real shm field."""
    context = zmq.Context()
    transport = ShmTransport(prefix=prefix, context=context)
    try:
        fields = transport.put(str(uuid.uuid4()), {"x": torch.zeros(4)})
        metadata = {"phase": "pipelined", "timed": True, "sent_ns": time.monotonic_ns()}
        handle = Handle(str(uuid.uuid4()), TOPIC, 12_345, 0, 0, 1, fields, metadata, producer="source-0")
        return encode(Deliver(handle))
    finally:
        transport.close()
        context.term()


# ---- baseline: plain pyzmq echo ------------------------------------------------------------


def _echo_server(conn: Connection) -> None:
    context = zmq.Context()
    sock = context.socket(zmq.ROUTER)
    conn.send(sock.bind_to_random_port("tcp://127.0.0.1"))
    while True:
        peer, body = sock.recv_multipart()
        if not body:
            break
        sock.send_multipart([peer, body])
    sock.close(linger=0)
    context.term()


def _echo(sock: zmq.Socket, message: bytes, count: int, window: int) -> None:
    sent = min(window, count)
    for _ in range(sent):
        sock.send(message)
    for _ in range(count):
        sock.recv()
        if sent < count:
            sock.send(message)
            sent += 1


def _pings_ns(sock: zmq.Socket, message: bytes, count: int) -> list[int]:
    """Round trips of one message at a time, each after SETTLE_S idle, as the paced phase does."""
    round_trips = []
    for _ in range(count):
        time.sleep(SETTLE_S)
        started = time.monotonic_ns()
        sock.send(message)
        sock.recv()
        round_trips.append(time.monotonic_ns() - started)
    return round_trips


def raw_baseline(message: bytes, settings: Settings) -> tuple[float, float]:
    """A DEALER here, a ROUTER echo in another process: messages echoed per second with
    RAW_WINDOW in flight, and the median round trip of one at a time in us (two socket hops,
    as a handle's way from producer through the broker to consumer)."""
    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    server = ctx.Process(target=_echo_server, args=(child_conn,), name="raw-echo")
    server.start()
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    try:
        if not conn.poll(TIMEOUT_S):
            raise TimeoutError("the echo server did not start")
        sock.connect(f"tcp://127.0.0.1:{conn.recv()}")
        _echo(sock, message, RAW_WINDOW, RAW_WINDOW)
        started = time.perf_counter()
        _echo(sock, message, settings.raw_messages, RAW_WINDOW)
        rate = settings.raw_messages / (time.perf_counter() - started)
        hop_us = statistics.median(_pings_ns(sock, message, settings.raw_pings)) / 1e3
        sock.send(b"")
        return rate, hop_us
    finally:
        sock.close(linger=1000)
        context.term()
        stop_process(server)


# ---- payload plane -------------------------------------------------------------------------


def _payload_consumer(conn: Connection, prefix: str, prefer: str) -> None:
    """Gets the tensor of each Deliver it is sent; answers with the time it held it."""
    context = zmq.Context()
    transport = ShmTransport(prefix=prefix, serve=False, prefer=prefer, context=context)
    while frame := conn.recv_bytes():
        tensors = transport.get(decode(frame).handle)
        conn.send(time.monotonic_ns())
        del tensors
    transport.close()
    context.term()


def payload_gbps(prefix: str, prefer: str, repeats: int) -> float:
    """64 MB put here, got by a consumer process: bytes / median(put start -> consumer holds)."""
    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    consumer = ctx.Process(target=_payload_consumer, args=(child_conn, prefix, prefer), name=f"payload-{prefer}")
    consumer.start()
    context = zmq.Context()
    transport = ShmTransport(prefix=prefix, context=context)
    tensor = torch.ones(PAYLOAD_BYTES // 4)  # (16e6,) float32
    times_ns = []
    try:
        for i in range(repeats + 1):
            handle_id = str(uuid.uuid4())
            started = time.monotonic_ns()
            fields = transport.put(handle_id, {"x": tensor})
            conn.send_bytes(encode(Deliver(Handle(handle_id, TOPIC, i, 0, 0, 1, fields, producer="bench"))))
            if not conn.poll(TIMEOUT_S):
                raise TimeoutError(f"the {prefer} consumer did not get the payload in {TIMEOUT_S}s")
            times_ns.append(conn.recv() - started)
            transport.release(handle_id)
        conn.send_bytes(b"")
    finally:
        stop_process(consumer)
        transport.close()
        context.term()
        assert_no_segments(prefix)
    return PAYLOAD_BYTES / statistics.median(times_ns[1:])  # bytes per ns = GB/s


def memcpy_gbps(repeats: int) -> float:
    src = np.ones(PAYLOAD_BYTES, dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # first touch of dst's pages is not timed
    times_ns = []
    for _ in range(repeats):
        started = time.perf_counter_ns()
        np.copyto(dst, src)
        times_ns.append(time.perf_counter_ns() - started)
    return PAYLOAD_BYTES / statistics.median(times_ns)


# ---- housekeeping --------------------------------------------------------------------------


def stop_process(process: mp.Process) -> None:
    process.join(10)
    if process.is_alive():
        process.terminate()
        process.join(5)


def assert_no_segments(prefix: str) -> None:
    """Unlink what a run left in /dev/shm, and fail: a leak is a bug, not a figure."""
    left = shm.list_segments(prefix)
    for name, _ in left:
        shm.unlink(name)
    if left:
        raise RuntimeError(f"{len(left)} shared-memory segment(s) left behind, e.g. {left[0][0]}")


def progress(text: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


# ---- report --------------------------------------------------------------------------------


def measure(settings: Settings) -> dict[str, float]:
    prefix = f"bench{uuid.uuid4().hex[:8]}"
    phase = f"{settings.warmup_s:g} s warm-up + {settings.timed_s:g} s timed"
    progress(f"1 consumer: handle throughput, then hop latency one handle at a time ({phase} each)")
    reports = run_job(prefix, settings, sinks=1, phases=["pipelined", "paced"])
    one = handles_per_s(reports)
    p50, p99 = hop_percentiles_us(reports)
    progress(f"4 consumers: handle throughput ({phase})")
    four = handles_per_s(run_job(prefix, settings, sinks=4, phases=["pipelined"]))
    message = deliver_bytes(prefix)
    progress(f"raw pyzmq echo ({settings.raw_messages} messages of {len(message)} bytes, {settings.raw_pings} pings)")
    raw, raw_hop_us = raw_baseline(message, settings)
    progress(f"payload plane, 64 MB x {settings.payload_repeats}: shm, tcp, memcpy")
    return {
        "handles_per_s": one,
        "handles_per_s_4c": four,
        "raw_msgs_per_s": raw,
        "p50_hop_us": p50,
        "p99_hop_us": p99,
        "shm_gbps": payload_gbps(prefix, "auto", settings.payload_repeats),
        "tcp_gbps": payload_gbps(prefix, "tcp", settings.payload_repeats),
        "memcpy_gbps": memcpy_gbps(settings.payload_repeats),
        "raw_hop_us": raw_hop_us,
        "deliver_bytes": len(message),
    }


def format_table(r: dict[str, float]) -> str:
    """Each figure beside its baseline, the ratio, the target and PASS/MISS."""
    raw = f"{r['raw_msgs_per_s']:,.0f} msg/s raw"
    memcpy = f"{r['memcpy_gbps']:.2f} GB/s memcpy"
    one, four = r["handles_per_s"] / r["raw_msgs_per_s"], r["handles_per_s_4c"] / r["raw_msgs_per_s"]
    hop_ratio = r["p50_hop_us"] / r["raw_hop_us"]
    shm_ratio, tcp_ratio = r["shm_gbps"] / r["memcpy_gbps"], r["tcp_gbps"] / r["memcpy_gbps"]
    rows = [
        ("figure", "value", "baseline", "ratio", "target", ""),
        ("handles/s, 1 consumer", f"{r['handles_per_s']:,.0f}", raw, f"{one:.3g}", ">= 0.5", verdict(one >= 0.5)),
        ("handles/s, 4 consumers", f"{r['handles_per_s_4c']:,.0f}", raw, f"{four:.3g}", "", ""),
        ("hop p50, us", f"{r['p50_hop_us']:,.0f}", f"{r['raw_hop_us']:,.0f} us raw", f"{hop_ratio:.3g}", "< 200 us",
         verdict(r["p50_hop_us"] < 200)),
        ("hop p99, us", f"{r['p99_hop_us']:,.0f}", "", "", "", ""),
        ("shm GB/s, 64 MB", f"{r['shm_gbps']:.2f}", memcpy, f"{shm_ratio:.3g}", ">= 0.5", verdict(shm_ratio >= 0.5)),
        ("tcp GB/s, 64 MB", f"{r['tcp_gbps']:.2f}", memcpy, f"{tcp_ratio:.3g}", ">= 0.25", verdict(tcp_ratio >= 0.25)),
    ]
    lines = [f"{n:<24} {v:>10} {b:>22} {q:>8} {t:>9}  {s}".rstrip() for n, v, b, q, t, s in rows]
    notes = [
        (f"raw: pyzmq DEALER/ROUTER echo, {RAW_WINDOW} in flight, {r['deliver_bytes']:.0f}-byte messages (one encoded "
         "Deliver); an echo is two socket hops, as producer -> broker -> consumer is; raw hop: median echo round "
         "trip of one message at a time"),
        ("hop: one-way, source step() -> sink step(), one handle in flight, time.monotonic_ns() stamped in the "
         "handle's metadata (same host)"),
        ("shm/tcp: producer put() -> consumer get() returned, median (shm: the consumer maps the segment, its first "
         "read faults the pages in, not timed); memcpy: numpy copy into a preallocated array, median"),
    ]
    return "\n".join([*lines, "", *notes])


def verdict(passed: bool) -> str:
    return "PASS" if passed else "MISS"


JSON_KEYS = ("handles_per_s", "handles_per_s_4c", "raw_msgs_per_s", "p50_hop_us", "p99_hop_us",
             "shm_gbps", "tcp_gbps", "memcpy_gbps")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="short smoke run: shorter phases, fewer repeats")
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last stdout line")
    args = parser.parse_args()
    results = measure(QUICK if args.quick else FULL)
    print(format_table(results))
    if args.json:
        print(json.dumps({key: round(results[key], 3) for key in JSON_KEYS}))


if __name__ == "__main__":
    main()
