"""Loopback by default; CURVE required beyond it; handshake refusals are clear and fatal; a peer
that floods the broker (publishes without credit, oversize frames, bad frames) is counted,
rejected and logged in a few lines, and the broker serves on."""

from __future__ import annotations

import threading

import pytest
import zmq

from stream_rlhf.broker import sockets
from stream_rlhf.broker.control.client import ControlClient, HandshakeError
from stream_rlhf.broker.control.messages import SCHEMA_VERSION, Error, Handle, Hello, Publish, Release, decode, encode
from stream_rlhf.broker.control.topology import BrokerConfig, CurveConfig, needs_curve
from stream_rlhf.broker.runtime.runner import StageRunner
from stream_rlhf.stage import Stage
from tests.broker_process import broker_process, raw_dealer, stats_once

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("address,needs", [
    ("tcp://127.0.0.1:5555", False), ("tcp://localhost:1", False), ("tcp://[::1]:1", False),
    ("ipc:///tmp/x", False), ("tcp://0.0.0.0:5555", True), ("tcp://10.1.2.3:5555", True),
    ("tcp://eth0:5555", True), ("tcp://*:5555", True),
])
def test_what_counts_as_loopback(address, needs):
    assert needs_curve(address) is needs


def test_router_refuses_to_bind_beyond_loopback_without_keys():
    context = zmq.Context()
    with pytest.raises(sockets.CurveKeyError, match="CURVE keys are required"):
        sockets.router(context, "tcp://0.0.0.0:*", None, 1024)
    context.term()


def test_missing_key_file_is_named(tmp_path):
    context = zmq.Context()
    with pytest.raises(sockets.CurveKeyError, match="broker.key_secret"):
        sockets.router(context, "tcp://0.0.0.0:*", str(tmp_path), 1024)
    context.term()


def test_curve_broker_admits_only_authorized_clients(tmp_path):
    keys = sockets.generate_keys(tmp_path / "keys")
    stranger = sockets.generate_keys(tmp_path / "stranger")  # a key pair the broker never saw
    config = BrokerConfig(address="tcp://0.0.0.0:*", curve=CurveConfig(str(keys)), shm_prefix="curve")
    with broker_process(config) as (process, address):
        local = address.replace("0.0.0.0", "127.0.0.1")
        with ControlClient(local, str(keys)) as client:
            assert client.stats()["instances"] == 1
        with pytest.raises(HandshakeError):
            ControlClient(local, str(stranger), timeout_s=2)
        with pytest.raises(HandshakeError):
            ControlClient(local, None, timeout_s=2)  # plaintext against a CURVE server
        assert process.is_alive()


def test_runner_without_keys_against_a_curve_broker_fails_and_never_hangs(tmp_path):
    """The broker never answers a plaintext peer, so the runner's io thread sat in a send with
    its socket open and `Context.term()` waited for it for ever after the HandshakeError."""
    keys = sockets.generate_keys(tmp_path / "keys")
    config = BrokerConfig(address="tcp://0.0.0.0:*", curve=CurveConfig(str(keys)), shm_prefix="curvehang")
    with broker_process(config) as (process, address):
        runner = StageRunner(Stage(), "src", "src-0", address.replace("0.0.0.0", "127.0.0.1"), handshake_timeout_s=1)
        failures: list[Exception] = []

        def run() -> None:
            try:
                runner.run()
            except HandshakeError as exc:
                failures.append(exc)

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        thread.join(timeout=60)
        assert not thread.is_alive(), "the runner hung after its failed handshake"
        assert len(failures) == 1 and "are the CURVE keys right?" in str(failures[0])
        assert process.is_alive()


def test_wrong_schema_version_is_a_fatal_refusal_naming_both_versions():
    with broker_process(BrokerConfig(address="tcp://127.0.0.1:*", shm_prefix="schema")) as (_, address):
        context = zmq.Context()
        sock = sockets.dealer(context, address, "old-stage", None)
        sock.send(encode(Hello(SCHEMA_VERSION + 1, "src", "old-stage")))
        assert sock.poll(5000)
        reply = decode(sock.recv())
        sock.close()
        context.term()
    assert isinstance(reply, Error) and reply.fatal and reply.code == "schema"
    assert f"{SCHEMA_VERSION + 1}" in reply.reason and f"{SCHEMA_VERSION}" in reply.reason


def test_runner_of_unknown_stage_fails_with_the_brokers_reason():
    with broker_process(BrokerConfig(address="tcp://127.0.0.1:*", shm_prefix="unknown")) as (_, address):
        runner = StageRunner(Stage(), "nobody", "nobody-0", address, handshake_timeout_s=10)
        with pytest.raises(HandshakeError, match="'nobody' is not in the topology"):
            runner.run()


def test_runner_without_broker_times_out_naming_the_address(free_port):
    address = f"tcp://127.0.0.1:{free_port}"
    runner = StageRunner(Stage(), "src", "src-0", address, handshake_timeout_s=1)
    with pytest.raises(HandshakeError, match=f"no READY from broker {address} within 1"):
        runner.run()


def test_a_source_publishing_without_credit_is_rejected_each_time_and_told_to_free_its_payloads():
    """A peer registered as the source publishes 20,000 handles, ignoring its credit: the broker
    queued them all (capacity 16). Now only what its credit covers is queued; every other one is
    rejected, counted and released back to it (it frees the payload), and the broker serves on."""
    capacity, n = 16, 20_000
    config = BrokerConfig(address="tcp://127.0.0.1:*", queue_capacity=capacity, shm_prefix="nocredit")
    with broker_process(config) as (process, address):
        context, sock = raw_dealer(address, b"src-0")
        try:
            sock.send(encode(Hello(SCHEMA_VERSION, "src", "src-0")))
            assert sock.poll(10_000)
            for start in range(0, n, 64):
                sock.send_multipart([encode(Publish(Handle(f"h{i}", "items", 0, i, 0, 1)))
                                     for i in range(start, min(n, start + 64))])
            stats = stats_once(address, lambda s: s.get("published", 0) + s.get("rejected.no_credit", 0) >= n)
            released = set()
            while sock.poll(2000):
                for frame in sock.recv_multipart():
                    reply = decode(frame)
                    if isinstance(reply, Release):
                        released.update(reply.handle_ids)
        finally:
            sock.close()
            context.term()
        assert process.is_alive()
    assert stats["published"] == capacity and stats["queue.items.sink"] == capacity
    assert stats["rejected.no_credit"] == n - capacity and stats.get("internal_errors", 0) == 0
    assert released <= {f"h{i}" for i in range(capacity, n)}  # none it queued; replies past the HWM are dropped
    assert released, "the rejected handles' payloads were never released to their producer"


def test_frames_over_the_limit_drop_their_connection_counted_and_logged(tmp_path):
    """libzmq cut 17 MB and 64 MB frames without a word; now each is counted and logged naming the
    limit, and control clients that close after saying goodbye are not counted with them."""
    log_path = tmp_path / "broker.log"
    config = BrokerConfig(address="tcp://127.0.0.1:*", shm_prefix="oversize")
    with broker_process(config, log_path=log_path) as (process, address):
        dealers = [raw_dealer(address, f"big-{i}".encode()) for i in range(2)]
        try:
            for (_, sock), size in zip(dealers, [17 << 20, 64 << 20], strict=True):
                sock.send(b"\x00" * size)
            stats = stats_once(address, lambda s: s.get("connections_dropped", 0) >= 2)
            stats = stats_once(address, lambda s: False, timeout_s=1.0)  # control clients came and went
        finally:
            for context, sock in dealers:
                sock.close()
                context.term()
        assert process.is_alive()
    assert stats["connections_dropped"] == 2 and stats.get("internal_errors", 0) == 0
    log = log_path.read_text()
    assert "closed without a goodbye: a frame over the 1,048,832-byte limit (max_message_bytes" in log


def test_a_flood_of_bad_frames_is_counted_in_full_and_logged_in_a_few_lines(tmp_path):
    """Ten HELLOs naming a 200 KB stage wrote 2 MB of log, a burst 16 MB in 3 s. Now each cause is
    logged once per window, peer text cut short, and the counters still count every frame."""
    log_path = tmp_path / "broker.log"
    config = BrokerConfig(address="tcp://127.0.0.1:*", shm_prefix="flood")
    longest = "s" * 256  # the longest stage name the wire allows
    with broker_process(config, log_path=log_path) as (process, address):
        context, sock = raw_dealer(address, b"flood")
        try:
            for stage in ["x" * 200_000] * 10 + [longest] * 10:
                sock.send(encode(Hello(SCHEMA_VERSION, stage, "flood")))
            for _ in range(10_000):
                sock.send(b"\xc1 not msgpack")
            stats = stats_once(address, lambda s: s.get("rejected.malformed", 0) >= 10_010)
        finally:
            sock.close()
            context.term()
        assert process.is_alive()
    assert stats["rejected.malformed"] == 10_010 and stats["rejected.unknown_stage"] == 10
    log = log_path.read_text()
    assert len(log) < 20_000, f"{len(log):,} bytes of log"
    assert "s" * 201 not in log  # the echoed stage name is cut
