"""Random, truncated and oversized frames thrown at a real broker process: it keeps serving."""

from __future__ import annotations

import time

import msgspec
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stream_rlhf.broker.client import ControlClient
from stream_rlhf.broker.messages import SCHEMA_VERSION, Error, Hello, decode, encode
from stream_rlhf.broker.shm import host_id
from stream_rlhf.broker.topology import BrokerConfig
from tests.broker_process import broker_process
from tests.test_messages import MESSAGES

pytestmark = pytest.mark.slow
LIMIT = 4096


@pytest.fixture(scope="module")
def broker():
    config = BrokerConfig(address="tcp://127.0.0.1:*", max_message_bytes=LIMIT, shm_prefix="fuzz")
    with broker_process(config) as (process, address):
        context = zmq.Context()
        sock = context.socket(zmq.DEALER)
        sock.linger = 0
        sock.connect(address)
        yield process, address, sock
        sock.close()
        context.term()


def valid_frames():
    return st.sampled_from([encode(m) for m in MESSAGES])


frames = st.one_of(
    st.binary(max_size=512),
    valid_frames().flatmap(lambda f: st.integers(0, len(f) - 1).map(lambda cut: f[:cut])),
    valid_frames().flatmap(lambda f: st.integers(0, len(f) - 1).map(lambda i: f[:i] + b"\xff" + f[i + 1:])),
    st.dictionaries(st.text(max_size=8), st.one_of(st.integers(-2**63, 2**63 - 1), st.text(max_size=8), st.none()), max_size=5)
    .map(msgspec.msgpack.encode),
    st.builds(lambda t: msgspec.msgpack.encode({"type": t}), st.text(max_size=10)),
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(message=st.lists(frames, min_size=1, max_size=3))
def test_broker_survives_garbage(broker, message):
    process, _, sock = broker
    sock.send_multipart(message)
    assert process.is_alive()


def test_oversized_message_rejected_with_reason(broker):
    _, _, sock = broker
    sock.send(b"\x00" * (LIMIT + 1))
    deadline = time.monotonic() + 10
    skipped = []  # replies to the garbage the other tests sent come first
    while True:
        left_ms = int((deadline - time.monotonic()) * 1000)
        assert left_ms > 0 and sock.poll(left_ms), (
            f"no Error 'oversize' within 10 s; {len(skipped)} other replies, the last: {skipped[-3:]}")
        reply = decode(sock.recv())
        if isinstance(reply, Error) and reply.code == "oversize":
            break
        skipped.append(reply)


def test_well_formed_client_still_served_after_fuzzing(broker):
    process, address, sock = broker
    sock.send_multipart([b"one", b"two", b"three"])  # wrong frame count
    with ControlClient(address) as client:
        stats = client.stats()
    assert process.is_alive()
    assert stats["rejected.malformed"] > 0 and stats["rejected.oversize"] >= 1
    assert stats["rejected"] >= stats["rejected.malformed"]
    assert stats.get("internal_errors", 0) == 0  # every frame was rejected on decode, none broke a handler


def test_a_hello_naming_an_impossible_pid_is_rejected_and_the_broker_outlives_its_heartbeat_check():
    """A schema-valid HELLO with this host's id and pid 2**40, then silence: the broker once
    removed the silent peer with os.kill(2**40, 0), and the OverflowError left its loop."""
    config = BrokerConfig(address="tcp://127.0.0.1:*", shm_prefix="fuzzpid", heartbeat_interval_s=0.1,
                          heartbeat_timeout_s=0.3)
    with broker_process(config) as (process, address):
        context = zmq.Context()
        sock = context.socket(zmq.DEALER)
        sock.linger = 0
        sock.connect(address)
        try:
            sock.send(encode(Hello(SCHEMA_VERSION, "rollout", "rollout-9", [], 2**40, host_id())))
            assert sock.poll(10_000)
            reply = decode(sock.recv())
            assert isinstance(reply, Error) and reply.code == "malformed" and "pid" in reply.reason
            time.sleep(4 * config.heartbeat_timeout_s)  # past the check that would have removed it
            with ControlClient(address) as client:
                stats = client.stats()
        finally:
            sock.close()
            context.term()
        assert process.is_alive()
        assert stats["rejected.malformed"] == 1 and stats.get("internal_errors", 0) == 0
