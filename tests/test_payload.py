"""Payload plane: tensors of every awkward kind through shared memory and over TCP."""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import time
from pathlib import Path

import msgspec
import pytest
import torch
import zmq

from stream_rlhf.broker.control.messages import (
    FetchRequest,
    FieldAt,
    Handle,
    Publish,
    Reclaim,
    decode,
    decode_fetch_reply,
    encode,
)
from stream_rlhf.broker.payload import host_server, shm
from stream_rlhf.broker.payload.host_server import HOST_SERVER_ENV, HostPayloadServer
from stream_rlhf.broker.payload.memory_transport import MemoryTransport
from stream_rlhf.broker.payload.remote_reclaim import REMOTE_COUNTER, RemoteReclaimer
from stream_rlhf.broker.payload.server import PayloadError
from stream_rlhf.broker.payload.transport import ShmTransport
from tests.waiting import wait_for

LARGE = 40_000  # float32 elements: past the small-payload slot size, so a segment of its own


def test_small_payloads_share_an_arena_and_are_copied_out(shm_prefix):
    producer = ShmTransport(prefix=shm_prefix, serve=False)
    consumer = ShmTransport(prefix=shm_prefix, serve=False)
    try:
        first = make_handle(producer.put("a", {"x": torch.full((100,), 1.0)}), "a")
        second = make_handle(producer.put("b", {"x": torch.full((100,), 2.0)}), "b")
        assert first.fields["x"].location.copy_out
        assert first.fields["x"].location.segment == second.fields["x"].location.segment
        kept = consumer.get(first)["x"]
        producer.release("a")
        third = make_handle(producer.put("c", {"x": torch.full((100,), 3.0)}), "c")
        assert third.fields["x"].location.offset == first.fields["x"].location.offset  # slot reused
        assert kept.tolist() == [1.0] * 100  # the consumer's copy is untouched
        assert consumer.get(third)["x"].tolist() == [3.0] * 100
        assert len(shm.list_segments(shm_prefix)) == 1
    finally:
        consumer.close()
        producer.close()


def awkward_tensors() -> dict[str, torch.Tensor]:
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    return {
        "fp32": torch.randn(3, 5),
        "bf16": torch.randn(7, 3).to(torch.bfloat16),
        "fp16": torch.randn(2, 2).half(),
        "int64": torch.arange(10),
        "bool": torch.tensor([True, False, True]),
        "empty": torch.empty(0, 4),
        "scalar": torch.tensor(3.5),
        "noncontig": base.t(),  # (6, 4) view with strides (1, 6)
        "sliced": base[:, ::2],
    }


def make_handle(fields, handle_id="h") -> Handle:
    handle = Handle(handle_id, "t", 0, 0, 0, 1, fields=fields, producer="p")
    return decode(encode(Publish(handle))).handle  # exactly what crosses the wire


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype, name
        assert got[name].shape == tensor.shape, name
        assert torch.equal(got[name], tensor), name


@pytest.mark.parametrize("prefer", ["auto", "tcp"])
def test_round_trip_awkward_tensors(shm_prefix, prefer):
    producer = ShmTransport(prefix=shm_prefix)
    consumer = ShmTransport(prefix=shm_prefix, serve=False, prefer=prefer)
    try:
        want = awkward_tensors()
        handle = make_handle(producer.put("h", want))
        assert_same(consumer.get(handle), want)
    finally:
        consumer.close()
        producer.close()


def mapped_file_of(address: int) -> str:
    """The file behind the memory mapping that holds `address` in this process (Linux)."""
    for line in open("/proc/self/maps"):
        span, *rest = line.split()
        start, end = (int(x, 16) for x in span.split("-"))
        if start <= address < end:
            return rest[4] if len(rest) > 4 else ""
    return ""


def test_local_get_is_zero_copy_and_copy_on_write(shm_prefix):
    producer = ShmTransport(prefix=shm_prefix, serve=False)
    try:
        handle = make_handle(producer.put("h", {"x": torch.zeros(LARGE)}))
        a = producer.get(handle)["x"]
        b = producer.get(handle)["x"]
        segment = handle.fields["x"].location.segment
        assert mapped_file_of(b.data_ptr()) == f"/dev/shm{segment}"  # a view of the segment, no copy
        a[0] = 42.0  # a consumer scribbling on its input must not corrupt another consumer's view
        assert b[0].item() == 0.0
    finally:
        producer.close()


def test_release_without_pool_unlinks_and_mapped_tensors_stay_valid(shm_prefix):
    producer = ShmTransport(prefix=shm_prefix, serve=False, pool_bytes=0)
    handle = make_handle(producer.put("h", {"x": torch.arange(LARGE, dtype=torch.float32)}))
    got = producer.get(handle)["x"]
    assert len(shm.list_segments(shm_prefix)) == 1
    producer.release("h")
    assert shm.list_segments(shm_prefix) == []
    assert got[:5].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
    with pytest.raises(PayloadError, match="is gone"):
        producer.get(handle)
    producer.close()


def test_segment_is_reused_only_once_no_consumer_maps_it(shm_prefix):
    import gc

    producer = ShmTransport(prefix=shm_prefix, serve=False)
    consumer = ShmTransport(prefix=shm_prefix, serve=False)
    try:
        first = make_handle(producer.put("h1", {"x": torch.full((LARGE,), 1.0)}), "h1")
        kept = consumer.get(first)["x"][10:20]  # a consumer keeps a view past its ack
        producer.release("h1")
        second = make_handle(producer.put("h2", {"x": torch.full((LARGE,), 2.0)}), "h2")
        assert second.fields["x"].location.segment != first.fields["x"].location.segment
        assert kept.tolist() == [1.0] * 10  # not overwritten
        del kept
        gc.collect()  # the last view is gone: the mapping and its lock with it
        producer.release("h2")
        third = make_handle(producer.put("h3", {"x": torch.full((LARGE,), 3.0)}), "h3")
        assert third.fields["x"].location.segment in {
            first.fields["x"].location.segment, second.fields["x"].location.segment
        }
        assert torch.equal(consumer.get(third)["x"], torch.full((LARGE,), 3.0))
        assert len(shm.list_segments(shm_prefix)) == 2  # pooled, not leaked
    finally:
        consumer.close()
        producer.close()


def test_tcp_fetch_of_released_handle_names_it(shm_prefix):
    producer = ShmTransport(prefix=shm_prefix)
    consumer = ShmTransport(prefix=shm_prefix, serve=False, prefer="tcp")
    try:
        handle = make_handle(producer.put("h7", {"x": torch.ones(3)}), "h7")
        producer.release("h7")
        with pytest.raises(PayloadError, match="h7"):
            consumer.get(handle)
    finally:
        consumer.close()
        producer.close()


@pytest.mark.parametrize("bad", [
    {"segment": ""}, {"segment": "/a/b"}, {"segment": "/../etc"}, {"segment": "no_slash"},
    {"offset": 1 << 30}, {"shape": [LARGE * 2], "nbytes": LARGE * 8},
])
def test_a_bad_location_is_a_payload_error_naming_the_handle(shm_prefix, bad):
    """What a hostile or broken producer could put in a handle never reaches shm_open or
    frombuffer unchecked: the consumer gets a PayloadError (and nacks), never an OSError."""
    producer = ShmTransport(prefix=shm_prefix, serve=False)
    try:
        spec = producer.put("h", {"x": torch.zeros(LARGE)})["x"]
        where = {k: v for k, v in bad.items() if k in ("segment", "offset")}
        size = {k: v for k, v in bad.items() if k in ("shape", "nbytes")}
        spec = msgspec.structs.replace(spec, location=msgspec.structs.replace(spec.location, **where), **size)
        with pytest.raises(PayloadError, match="handle h field 'x'"):
            producer.get(make_handle({"x": spec}))
    finally:
        producer.close()


def test_non_tensor_is_refused_with_a_clear_error(shm_prefix):
    producer = ShmTransport(prefix=shm_prefix, serve=False)
    try:
        with pytest.raises(PayloadError, match="field 'x'.*tensor"):
            producer.put("h", {"x": [1, 2, 3]})
    finally:
        producer.close()


def test_close_unlinks_everything_held(shm_prefix):
    producer = ShmTransport(prefix=shm_prefix, serve=False)
    for i in range(3):
        producer.put(f"h{i}", {"x": torch.ones(LARGE)})
    producer.put("small", {"x": torch.ones(10)})
    assert len(shm.list_segments(shm_prefix)) == 4  # three of their own, one slot arena
    producer.close()
    assert shm.list_segments(shm_prefix) == []


def _consume(handle_bytes: bytes, queue) -> None:
    handle = decode(handle_bytes).handle
    consumer = ShmTransport(prefix="unused", serve=False)
    tensors = consumer.get(handle)
    queue.put({k: (str(v.dtype), list(v.shape), v.float().sum().item()) for k, v in tensors.items()})
    consumer.close()


@pytest.mark.slow
def test_other_process_maps_the_segment(shm_prefix):
    producer = ShmTransport(prefix=shm_prefix, serve=False)
    want = awkward_tensors()
    handle = make_handle(producer.put("h", want))
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    child = ctx.Process(target=_consume, args=(encode(Publish(handle)), queue))
    child.start()
    got = queue.get(timeout=60)
    child.join(30)
    producer.close()
    assert child.exitcode == 0
    for name, tensor in want.items():
        assert got[name] == (str(tensor.dtype), list(tensor.shape), pytest.approx(tensor.float().sum().item()))


def test_sweep_reclaims_segments_of_dead_processes_only(shm_prefix):
    import os

    live = shm.create(shm.segment_name(shm_prefix, os.getpid(), 0), 16)
    dead_pid = 2**22 + 12345  # above pid_max on this machine: no such process
    os.close(shm.create(shm.segment_name(shm_prefix, dead_pid, 0), 16).fd)
    assert shm.sweep(shm_prefix) == 1
    assert [pid for _, pid in shm.list_segments(shm_prefix)] == [os.getpid()]
    live.destroy()


def test_memory_transport_round_trip():
    transport = MemoryTransport()
    want = awkward_tensors()
    handle = make_handle(transport.put("h", want))
    assert_same(transport.get(handle), want)
    transport.release("h")
    with pytest.raises(PayloadError):
        transport.get(handle)


def test_a_request_over_the_limit_drops_its_connection_counted_and_logged(shm_prefix, caplog):
    """The payload server read three 64 MB frames in full; now libzmq refuses a request over
    REQUEST_BYTES by closing its connection, and the server counts and logs it naming the limit.
    A consumer that closes after its fetches says goodbye and is not counted."""
    producer = ShmTransport(prefix=shm_prefix)
    consumer = ShmTransport(prefix=shm_prefix, serve=False, prefer="tcp")
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.linger = 0
    try:
        want = {"x": torch.arange(LARGE, dtype=torch.float32)}
        handle = make_handle(producer.put("h", want))
        assert_same(consumer.get(handle), want)
        consumer.close()
        sock.connect(producer.endpoint)
        sock.send_multipart([b"", b"\x00" * (64 << 20)])
        wait_for(lambda: producer.counters.get("payload.connections_dropped", 0) >= 1, 10,
                 "the payload server to drop the connection of the request over the limit")
        served = ShmTransport(prefix=shm_prefix, serve=False, prefer="tcp")
        assert_same(served.get(handle), want)  # the server serves on
        served.close()
        time.sleep(0.5)  # time for the goodbyes' disconnects to be judged
        dropped = producer.counters["payload.connections_dropped"]
    finally:
        sock.close()  # libzmq reconnected it: this close is one more dropped connection
        context.term()
        producer.close()
    assert dropped == 1
    assert "a frame over the 65,536-byte limit (payload_server.REQUEST_BYTES)" in caplog.text


def _produce_then_die(prefix: str, endpoint: str, queue) -> None:
    """A producer on the host whose payload server is `endpoint`: puts a large and a small payload,
    sends their handles, puts a third it does not send, and dies without releasing or closing anything (a crash)."""
    import os

    os.environ[HOST_SERVER_ENV] = endpoint
    producer = ShmTransport(prefix=prefix)
    large = make_handle(producer.put("large", {"x": torch.arange(LARGE, dtype=torch.float32)}), "large")
    small = make_handle(producer.put("small", {"y": torch.full((10,), 7, dtype=torch.int64)}), "small")
    producer.put("unsent", {"z": torch.zeros(LARGE)})  # never published
    queue.put((encode(Publish(large)), encode(Publish(small)), producer.endpoint))
    queue.close()
    queue.join_thread()  # flushed: _exit skips the queue's own exit handler
    os._exit(0)


def _a_producer_that_died(prefix: str, endpoint: str) -> tuple[tuple[Handle, Handle], int]:
    """The large and small handles `_produce_then_die` published in a spawned process, once it
    died; and its pid."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    child = ctx.Process(target=_produce_then_die, args=(prefix, endpoint, queue))
    child.start()
    large_bytes, small_bytes, served_by = queue.get(timeout=60)
    child.join(30)
    assert child.exitcode == 0 and served_by == endpoint  # no server of its own
    return (decode(large_bytes).handle, decode(small_bytes).handle), child.pid


def test_the_hosts_payload_server_serves_what_a_producer_that_died_had_published(shm_prefix):
    """A consumer on another host (here: fetching over TCP) gets both payloads from the host's
    server after their producer died; requests for another job's segment, a field past its
    segment and a field without its place are refused, naming the handle."""
    server = HostPayloadServer(shm_prefix, "127.0.0.1", None)
    consumer = ShmTransport(prefix="unused", serve=False, prefer="tcp", fetch_timeout_s=10.0)
    try:
        (large, small), _ = _a_producer_that_died(shm_prefix, server.endpoint)
        assert torch.equal(consumer.get(large)["x"], torch.arange(LARGE, dtype=torch.float32))
        assert consumer.get(small)["y"].tolist() == [7] * 10
        spec = large.fields["x"]
        for location, why in (
            (msgspec.structs.replace(spec.location, segment="/other_1_0"), "is not one of this job's"),
            (msgspec.structs.replace(spec.location, offset=spec.nbytes), "run past the"),
        ):
            bad = msgspec.structs.replace(large, fields={"x": msgspec.structs.replace(spec, location=location)})
            with pytest.raises(PayloadError, match=why):
                consumer.get(bad)
        sock = consumer._fetch_socket(server.endpoint)
        sock.send(encode(FetchRequest("large", ["x"])))
        assert "serves fields by place" in decode_fetch_reply(sock.recv_multipart()[0]).error
        assert server.counters["payload.rejected.not_held"] == 3
    finally:
        consumer.close()
        server.stop()
        for name, _ in shm.list_segments(shm_prefix):  # what the dead producer left (a host's sweep removes it)
            shm.unlink(name)


def test_the_hosts_payload_server_unlinks_what_the_broker_names_of_producers_gone_from_its_host(shm_prefix, caplog):
    """The broker's reclaimer asks the host's server: a dead producer's segments go but the one a
    live handle points into (still served); then that one once named. A live process keeps its
    segments; another job's segment and a producer's own server are refused, and logged."""
    server = HostPayloadServer(shm_prefix, "127.0.0.1", None)
    context = zmq.Context()
    stats: dict[str, float] = {}
    reclaimer = RemoteReclaimer(context, None, stats)
    consumer = ShmTransport(prefix="unused", serve=False, prefer="tcp", fetch_timeout_s=10.0)
    live = ShmTransport(prefix=shm_prefix)  # this process: alive, with a payload server of its own
    try:
        (large, _), dead = _a_producer_that_died(shm_prefix, server.endpoint)
        kept = large.fields["x"].location.segment
        assert len([name for name, pid in shm.list_segments(shm_prefix) if pid == dead]) == 3
        live.put("mine", {"w": torch.ones(LARGE)})
        mine = {name for name, pid in shm.list_segments(shm_prefix) if pid != dead}

        reclaimer.send(server.endpoint, Reclaim(dead_pid=dead, keep=[kept]))
        wait_for(lambda: stats[REMOTE_COUNTER] == 2, 10, "the arena and the unsent payload unlinked")
        assert {name for name, _ in shm.list_segments(shm_prefix)} == {kept, *mine}
        assert torch.equal(consumer.get(large)["x"], torch.arange(LARGE, dtype=torch.float32))

        reclaimer.send(server.endpoint, Reclaim(dead_pid=os.getpid()))  # alive: nothing goes
        reclaimer.send(server.endpoint, Reclaim(segments=[kept]))  # acknowledged since
        wait_for(lambda: stats[REMOTE_COUNTER] == 3, 10, "the acknowledged payload unlinked")
        assert {name for name, _ in shm.list_segments(shm_prefix)} == mine
        with pytest.raises(PayloadError, match="is gone from this host"):
            consumer.get(large)
        assert server.counters["payload.reclaimed"] == 3

        with caplog.at_level(logging.WARNING, logger="stream_rlhf.broker.payload.remote_reclaim"):
            reclaimer.send(server.endpoint, Reclaim(segments=["/other_1_0"]))
            reclaimer.send(live.endpoint, Reclaim(segments=list(mine)))
            reclaimer.stop()
        assert f"refused a reclaim: segment '/other_1_0' is not one of this job's ({shm_prefix})" in caplog.text
        assert "refused a reclaim: this payload server holds one producer's payloads" in caplog.text
        assert {name for name, _ in shm.list_segments(shm_prefix)} == mine and stats[REMOTE_COUNTER] == 3
        assert server.counters["payload.rejected.refused"] == 1 and live.counters["payload.rejected.refused"] == 1
    finally:
        reclaimer.stop()
        context.term()
        consumer.close()
        live.close()
        server.stop()


def test_the_hosts_payload_server_lets_go_of_segments_their_producer_unlinked(shm_prefix, monkeypatch):
    """A mapping keeps its segment's memory: once the producer unlinked the segment (its pool let
    it go), the server drops its mapping at its next turn, with no request coming in."""
    monkeypatch.setattr(host_server, "UNLINKED_CHECK_S", 0.0)
    server = HostPayloadServer(shm_prefix, "127.0.0.1", None)
    consumer = ShmTransport(prefix="unused", serve=False, prefer="tcp", fetch_timeout_s=10.0)
    made = [shm.create(shm.segment_name(shm_prefix, os.getpid(), n), 4096) for n in range(2)]
    try:
        sock = consumer._fetch_socket(server.endpoint)
        for n, segment in enumerate(made):
            segment.mapping[:4] = bytes([n + 1] * 4)
            sock.send(encode(FetchRequest(f"h{n}", ["x"], [FieldAt(segment.name, 0, 4)])))
            assert sock.recv_multipart()[1] == bytes([n + 1] * 4)
        made[0].destroy()  # unlinked by its producer: the server's mapping alone keeps its memory
        made[0].mapping.close()
        wait_for(lambda: not _mapped_here(made[0].name), 10, "the host's server kept an unlinked segment mapped")
        sock.send(encode(FetchRequest("h0", ["x"], [FieldAt(made[0].name, 0, 4)])))
        assert "is gone from this host" in decode_fetch_reply(sock.recv_multipart()[0]).error
    finally:
        consumer.close()
        server.stop()
        made[1].destroy()


def _mapped_here(segment: str) -> bool:
    """Whether this process maps `segment`, unlinked or not (/proc/self/maps)."""
    path = f"/dev/shm/{segment.lstrip('/')}"
    return any(line.endswith((path, f"{path} (deleted)")) for line in Path("/proc/self/maps").read_text().splitlines())
