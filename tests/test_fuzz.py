"""Every wire message type, with random and boundary field values, thrown at a real broker process.

Each example is one raw DEALER that may say hello first (as a source, a sink or a control client)
and then sends a few messages built from per-type strategies (huge and negative ints, pid 2**40,
names past the wire's bounds, bad segment names, NaN, unknown literals), encoded by the project's
own encoder, mixed with random, truncated and corrupted frames. After the last example the test
waits past the heartbeat timeout (the broker's check of silent peers once died of one such
HELLO) and asserts that the broker lives, that `internal_errors` did not move (a handler that
raised is counted there, never hidden) and that a well-formed client is served.
"""

from __future__ import annotations

import time

import msgspec
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stream_rlhf.broker.control.client import ControlClient
from stream_rlhf.broker.control.messages import (
    PID_MAX,
    SCHEMA_VERSION,
    Ack,
    Control,
    Deliver,
    Error,
    FieldSpec,
    Handle,
    Heartbeat,
    Hello,
    Location,
    Message,
    Nack,
    Publish,
    Ready,
    Release,
    Request,
    Stats,
    decode,
    encode,
)
from stream_rlhf.broker.control.topology import BrokerConfig
from stream_rlhf.broker.payload.shm import host_id
from tests.broker_process import broker_process, raw_dealer
from tests.test_messages import MESSAGES

LIMIT = 16384
PREFIX = "fuzz"
CONFIG = BrokerConfig(address="tcp://127.0.0.1:*", max_message_bytes=LIMIT, shm_prefix=PREFIX,
                      heartbeat_interval_s=0.1, heartbeat_timeout_s=0.3, queue_capacity=4)

ints = st.one_of(
    st.integers(-(2**63), 2**64 - 1),
    st.sampled_from([0, 1, -1, 2**31, 2**40, 2**40 + 1, 2**63 - 1, -(2**63), 2**64 - 1, PID_MAX, PID_MAX + 1]),
)
names = st.one_of(
    st.sampled_from(["src", "sink", "items", "_control", "*", "", "src-0", "a:b", "x" * 256, "x" * 257]),
    st.text(max_size=12),
    st.text(min_size=250, max_size=300),
)
texts = st.one_of(st.text(max_size=40), st.just("r" * 4097))
floats = st.floats(allow_nan=True, allow_infinity=True)
# segment names: this broker's prefix (no such segment exists), and names shm_open would refuse;
# never another job's prefix, whose segments are real
segments = st.sampled_from(["", "/", "a/b", "/../x", f"/{PREFIX}_1_0", f"/{PREFIX}_{2**40}_0", f"{PREFIX}_1_0",
                            "/" + "s" * 300])
locations = st.builds(
    Location, kind=st.sampled_from(["shm", "memory", "gpu"]), segment=segments, offset=ints,
    host=st.sampled_from(["", host_id(), "elsewhere"]), endpoint=st.sampled_from(["", "tcp://127.0.0.1:1", "e" * 5000]),
    copy_out=st.booleans(),
)
field_specs = st.builds(
    FieldSpec, dtype=st.sampled_from(["float32", "bfloat16", "nope", "", "d" * 300]),
    shape=st.lists(ints, max_size=20), nbytes=ints, location=locations,
)
metadata_values = st.one_of(st.none(), st.booleans(), ints, floats, texts, st.lists(st.one_of(ints, texts), max_size=4))
handles = st.builds(
    Handle, id=names, topic=st.sampled_from(["items", "nope", ""]) | names, iteration=ints, minibatch=ints,
    policy_version=ints, num_samples=ints, fields=st.dictionaries(names, field_specs, max_size=3),
    metadata=st.dictionaries(names, metadata_values, max_size=3), producer=names, parents=st.lists(names, max_size=3),
)
hellos = st.builds(
    Hello, schema_version=st.sampled_from([SCHEMA_VERSION, SCHEMA_VERSION + 1, -1]) | ints,
    stage=st.sampled_from(["src", "sink", "_control"]) | names, instance_id=names,
    capabilities=st.lists(names, max_size=3), pid=ints, host=st.sampled_from(["", host_id(), "elsewhere"]) | names,
    payload_server=st.sampled_from(["", "tcp://127.0.0.1:1", "not an address", "tcp://[::1"]) | texts,
)
prior_hellos = st.builds(  # registers the example's peer before its other messages, often as a
    # process of this host whose pid the heartbeat check probes once the peer falls silent
    Hello, schema_version=st.just(SCHEMA_VERSION), stage=st.sampled_from(["src", "sink", "_control"]),
    instance_id=names, capabilities=st.lists(names, max_size=3),
    pid=st.sampled_from([1, 2**31, 2**40, 2**63 - 1, PID_MAX, PID_MAX + 1, -1]) | ints,
    host=st.sampled_from([host_id(), host_id(), "", "elsewhere"]),
    # another host's payload server, which the broker asks to reclaim once the peer is gone
    payload_server=st.sampled_from(["", "tcp://127.0.0.1:1", "not an address"]),
)
MESSAGE_STRATEGIES = {
    Hello: hellos,
    Ready: st.builds(Ready, schema_version=ints, broker_id=names, heartbeat_interval_s=floats, max_message_bytes=ints,
                     inputs=st.lists(names, max_size=3), outputs=st.lists(names, max_size=3)),
    Publish: st.builds(Publish, handle=handles),
    Request: st.builds(Request, topic=st.sampled_from(["items"]) | names, credits=ints),
    Deliver: st.builds(Deliver, handle=handles, attempt=ints),
    Ack: st.builds(Ack, handle_ids=st.lists(names, max_size=5)),
    Nack: st.builds(Nack, handle_id=names, reason=texts, requeue=st.booleans()),
    Release: st.builds(Release, handle_ids=st.lists(names, max_size=5)),
    Heartbeat: st.builds(Heartbeat, state=st.sampled_from(["running", "draining", "stopped", "dead"]), inflight=ints),
    # shutdown is left out: any registered peer may stop the broker, that is its job
    Control: st.builds(Control, op=st.sampled_from(["weights_ready", "pause", "resume", "drain", "stats", "bogus"]),
                       target=st.sampled_from(["*", "src", "sink"]) | names, version=ints),
    Stats: st.builds(Stats, source=names, counters=st.dictionaries(texts, floats, max_size=4)),
    Error: st.builds(Error, reason=texts, fatal=st.booleans(), code=names),
}
typed_frames = st.one_of(*MESSAGE_STRATEGIES.values()).map(encode)
valid_frames = st.sampled_from([encode(m) for m in MESSAGES])
garbage_frames = st.one_of(
    st.binary(max_size=512),
    valid_frames.flatmap(lambda f: st.integers(0, len(f) - 1).map(lambda cut: f[:cut])),
    valid_frames.flatmap(lambda f: st.integers(0, len(f) - 1).map(lambda i: f[:i] + b"\xff" + f[i + 1:])),
    st.dictionaries(st.text(max_size=8), st.one_of(ints, st.text(max_size=8), st.none()), max_size=5)
    .map(msgspec.msgpack.encode),
    st.builds(lambda t: msgspec.msgpack.encode({"type": t}), st.text(max_size=10)),
)


def test_every_message_type_is_covered():
    assert set(MESSAGE_STRATEGIES) == set(Message.__args__)


def fuzz(max_examples: int) -> dict[str, float]:
    """Run `max_examples` examples against a fresh broker; returns its counters afterwards."""
    with broker_process(CONFIG) as (process, address):
        context = zmq.Context()

        @settings(max_examples=max_examples, deadline=None, database=None,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
        @given(hello=st.none() | prior_hellos,
               frames=st.lists(st.one_of(typed_frames, garbage_frames), min_size=1, max_size=4),
               one_message=st.booleans())
        def send(hello: Hello | None, frames: list[bytes], one_message: bool) -> None:
            sock = context.socket(zmq.DEALER)
            sock.linger = 2000  # close() waits until the frames left: with 0 they may never reach the broker
            sock.connect(address)
            try:
                if hello is not None:
                    sock.send(encode(hello))
                if one_message:
                    sock.send_multipart(frames)
                else:
                    for frame in frames:
                        sock.send(frame)
            finally:
                sock.close()
            assert process.is_alive()

        try:
            send()
            time.sleep(4 * CONFIG.heartbeat_timeout_s)  # past the check that removes silent peers
            assert process.is_alive(), f"the broker died (exit code {process.exitcode})"
            with ControlClient(address) as client:  # a well-formed client is served
                stats = client.stats()
            with ControlClient(address) as client:
                client.control("pause", "sink")
                after = client.stats()
        finally:
            context.term()
        assert process.is_alive()
    assert stats["rejected"] > 0 and after["rejected"] >= stats["rejected"]
    assert after.get("internal_errors", 0) == 0, "a handler raised: see the broker's log"
    return after


@pytest.mark.slow
def test_typed_fuzz_leaves_the_broker_serving_without_internal_errors():
    fuzz(max_examples=150)


@pytest.mark.slow
def test_typed_fuzz_longer_run():
    fuzz(max_examples=2000)


@pytest.mark.slow
def test_oversized_message_rejected_with_reason():
    """A frame just over max_message_bytes (within libzmq's CURVE allowance) is read and answered
    with an Error saying why; one far over it is refused by libzmq (test_security.py)."""
    with broker_process(CONFIG) as (_, address):
        context, sock = raw_dealer(address)
        try:
            sock.send(b"\x00" * (LIMIT + 1))
            assert sock.poll(10_000)
            reply = decode(sock.recv())
        finally:
            sock.close()
            context.term()
    assert isinstance(reply, Error) and reply.code == "oversize" and f"{LIMIT}" in reply.reason


@pytest.mark.slow
def test_a_hello_naming_an_impossible_pid_is_rejected_and_the_broker_outlives_its_heartbeat_check():
    """A schema-valid HELLO with this host's id and pid 2**40, then silence: the broker once
    removed the silent peer with os.kill(2**40, 0), and the OverflowError left its loop."""
    with broker_process(CONFIG) as (process, address):
        context, sock = raw_dealer(address)
        try:
            sock.send(encode(Hello(SCHEMA_VERSION, "src", "src-9", [], 2**40, host_id())))
            assert sock.poll(10_000)
            reply = decode(sock.recv())
            assert isinstance(reply, Error) and reply.code == "malformed" and "pid" in reply.reason
            time.sleep(4 * CONFIG.heartbeat_timeout_s)  # past the check that would have removed it
            with ControlClient(address) as client:
                stats = client.stats()
        finally:
            sock.close()
            context.term()
        assert process.is_alive()
        assert stats["rejected.malformed"] == 1 and stats.get("internal_errors", 0) == 0
