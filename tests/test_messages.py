"""Wire types: every message round-trips; wrong types, unknown tags and truncation are rejected."""

from __future__ import annotations

import msgspec
import pytest

from stream_rlhf.broker.control.messages import (
    SCHEMA_VERSION,
    Ack,
    Control,
    Deliver,
    Error,
    FetchReply,
    FetchRequest,
    FieldSpec,
    Handle,
    Heartbeat,
    Hello,
    Location,
    MessageRejected,
    Nack,
    Publish,
    Ready,
    Reclaim,
    ReclaimReply,
    Release,
    Request,
    Stats,
    decode,
    decode_fetch_reply,
    decode_payload_request,
    decode_reclaim_reply,
    encode,
)

HANDLE = Handle(
    id="h1", topic="rollout", iteration=3, minibatch=1, policy_version=2, num_samples=8,
    fields={
        "input_ids": FieldSpec("int64", [8, 128], 8 * 128 * 8, Location("shm", "/srlhf_1_0", 0, "host:ab", "tcp://127.0.0.1:9")),
        "logp": FieldSpec("bfloat16", [8, 128], 8 * 128 * 2, Location("shm", "/srlhf_1_0", 8192)),
        "empty": FieldSpec("float32", [0, 4], 0, Location("shm", "/srlhf_1_0", 10240)),
        "scalar": FieldSpec("float32", [], 4, Location("memory", "h1")),
    },
    metadata={"n": 1, "x": 0.5, "s": "a", "flag": True, "none": None, "lst": [1, 2]},
    producer="rollout-0",
    parents=["p1", "p2"],
)

MESSAGES = [
    Hello(SCHEMA_VERSION, "rollout", "rollout-0", ["vllm"], 123, "host"),
    Ready(SCHEMA_VERSION, "b1", 0.5, 1 << 20, ["prompts"], ["rollout"]),
    Publish(HANDLE),
    Request("prompts", 3),
    Deliver(HANDLE, attempt=2),
    Ack(["h1", "h2"]),
    Nack("h1", "boom", requeue=False),
    Release(["h1"]),
    Heartbeat("draining", 2),
    Control("weights_ready", "*", 7),
    Control("pause", "rollout"),
    Stats("rollout-0", {"steps": 3.0}),
    Error("bad", True, "schema"),
]


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__ + getattr(m, "op", ""))
def test_round_trip_every_message_type(message):
    assert decode(encode(message)) == message


def test_fetch_messages_round_trip():
    assert decode_payload_request(encode(FetchRequest("h1", ["a", "b"]))) == FetchRequest("h1", ["a", "b"])
    assert decode_fetch_reply(encode(FetchReply("gone"))) == FetchReply("gone")
    reclaim = Reclaim(segments=["/job_7_1"], dead_pid=7, keep=["/job_7_2"])
    assert decode_payload_request(encode(reclaim)) == reclaim
    assert decode_reclaim_reply(encode(ReclaimReply(2))) == ReclaimReply(2)
    with pytest.raises(MessageRejected, match="Expected `int`"):
        decode_payload_request(msgspec.msgpack.encode({"type": "reclaim", "dead_pid": "7"}))


def test_field_of_wrong_type_is_rejected_at_decode():
    raw = msgspec.msgpack.encode({"type": "request", "topic": "prompts", "credits": "three"})
    with pytest.raises(MessageRejected, match="credits"):
        decode(raw)


def test_nested_wrong_type_in_handle_is_rejected():
    bad = msgspec.to_builtins(Publish(HANDLE))
    bad["handle"]["fields"]["logp"]["shape"] = ["8", 128]
    with pytest.raises(MessageRejected, match="shape"):
        decode(msgspec.msgpack.encode(bad))


def test_unknown_message_type_is_rejected():
    with pytest.raises(MessageRejected):
        decode(msgspec.msgpack.encode({"type": "teleport", "where": "mars"}))


@pytest.mark.parametrize("cut", [1, 5, 20, -1])
def test_truncated_frame_is_rejected(cut):
    frame = encode(Publish(HANDLE))
    with pytest.raises(MessageRejected):
        decode(frame[:cut])


def test_pickle_is_never_accepted():
    import pickle

    with pytest.raises(MessageRejected):
        decode(pickle.dumps(Ack(["h1"])))
