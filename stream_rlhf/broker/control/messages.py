"""Every message that crosses a stream-rlhf socket, and the one codec that reads and writes them.

Control plane (stage <-> broker, one MessagePack frame per message):

    stage                          broker
      | Hello(schema, stage, id) ---> |   handshake; Error if the schema or stage is wrong
      | <--------------------- Ready  |
      | Request(topic, credits) ----> |   consumer credit: "I can take n more"
      | <------ Request(topic, n)     |   producer credit: "you may publish n more"
      | Publish(handle) ------------> |   broker journals it and answers Ack([id])
      | <------------ Deliver(handle) |   at-least-once: in flight until acked
      | Ack([ids]) / Nack(id) ------> |
      | <----------- Release([ids])   |   every consumer acked: producer frees the payload
      | Heartbeat(state) <----------> |   both ways; missed heartbeats = dead peer
      | <------------ Control(op)     |   weights_ready(version), pause, resume, drain, shutdown
      | Stats(counters) <-----------> |

Rank group (a stage instance's leader -> its other ranks, over torch.distributed, `stream_rlhf/distributed.py`):
GroupSetup once after the handshake, then GroupBatch per delivered handle, GroupWeights per
weights_ready, GroupStop last.

Payload plane (consumer -> producer's payload server): FetchRequest, answered by FetchReply
followed by one raw frame per requested field (tensor bytes, sent and received zero-copy). Broker ->
another host's payload server: Reclaim, answered by ReclaimReply.

Glossary: a *handle* names one mini-batch of one topic: where its tensors are, never the tensor
bytes. *iteration* is the rollout batch index, *minibatch* the index inside it, *policy_version*
the number of optimizer steps behind the weights that produced the samples.

Fields are append-only: add new fields at the end with a default, and bump SCHEMA_VERSION when a
change would break an older peer. Pickle is never used. Every field is bounded where it is decoded
(names, texts, ids, counts, offsets, shapes, pids): a frame outside the bounds is rejected like a
malformed one, so no handler ever sees, say, a pid that `os.kill` cannot take.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

SCHEMA_VERSION = 1
PID_MAX = 1 << 22
"""Linux's largest pid_max: no process id is larger."""

Name = Annotated[str, Meta(max_length=256)]
"""Stage, instance, topic, field, host, dtype and handle names; shared-memory segment names."""
Text = Annotated[str, Meta(max_length=4096)]
"""Free text: reasons, addresses."""
Count = Annotated[int, Meta(ge=0, le=1 << 40)]
"""Indices, counts, byte sizes and offsets."""
Version = Annotated[int, Meta(ge=-1, le=1 << 40)]
"""A policy or weight version; -1 where none applies."""
Pid = Annotated[int, Meta(ge=0, le=PID_MAX)]
Names = Annotated[list[Name], Meta(max_length=1 << 16)]

MetadataValue = int | float | str | bool | None | list[int | float | str | bool]
"""Per-handle values (per-sample lists such as reference answers): bounded by the frame size alone."""
RunnerState = Literal["running", "draining", "stopped"]
ControlOp = Literal["weights_ready", "pause", "resume", "drain", "shutdown", "stats"]
LocationKind = Literal["shm", "memory"]


class Location(msgspec.Struct, frozen=True):
    """Where one field's bytes live.

    kind: "shm" (POSIX shared memory segment on `host`, also served over TCP at `endpoint`)
          or "memory" (the in-process transport used by tests).
    segment: shared-memory name (shm) or store key (memory).
    offset: byte offset of the field inside the segment.
    host: host id of the producer; a consumer on the same host maps the segment directly.
    endpoint: ZMQ address of the producer's payload server, for consumers on other hosts.
    copy_out: the bytes sit in a slot the producer reuses once the handle is released, so a
    consumer copies them out instead of keeping a view (small payloads).
    """

    kind: LocationKind
    segment: Name
    offset: Count = 0
    host: Name = ""
    endpoint: Text = ""
    copy_out: bool = False


class FieldSpec(msgspec.Struct, frozen=True):
    """One tensor of a handle: dtype name (torch, e.g. "bfloat16"), shape, size and location."""

    dtype: Name
    shape: Annotated[list[Count], Meta(max_length=16)]
    nbytes: Count
    location: Location


class Handle(msgspec.Struct, frozen=True):
    """One mini-batch of one topic. The broker routes these; the bytes stay with the producer.

    parents: for a joined handle, the ids of the part handles it merges (their payloads live as
    long as the joined handle is unacknowledged).
    """

    id: Name
    topic: Name
    iteration: Count
    minibatch: Count
    policy_version: Version
    num_samples: Count
    fields: Annotated[dict[Name, FieldSpec], Meta(max_length=256)] = {}
    metadata: Annotated[dict[Name, MetadataValue], Meta(max_length=256)] = {}
    producer: Name = ""
    parents: Names = []


class Hello(msgspec.Struct, tag="hello", frozen=True):
    """First message of a stage instance (or of a control client, stage "_control")."""

    schema_version: int
    stage: Name
    instance_id: Name
    capabilities: Annotated[list[Name], Meta(max_length=64)] = []
    pid: Pid = 0
    host: Name = ""
    payload_server: Text = ""
    """The payload server of the instance's host, when the launcher runs one there
    (`payload/host_server.py`): the broker asks it to unlink what a producer there left."""


class Ready(msgspec.Struct, tag="ready", frozen=True):
    """Broker's answer to Hello: the instance is registered with these settings."""

    schema_version: int
    broker_id: Name
    heartbeat_interval_s: Annotated[float, Meta(gt=0, le=3600)]
    max_message_bytes: Count
    inputs: Names = []
    outputs: Names = []


class Publish(msgspec.Struct, tag="publish", frozen=True):
    handle: Handle


class Request(msgspec.Struct, tag="request", frozen=True):
    """Credit. Consumer -> broker: deliver `credits` more handles of `topic`.
    Broker -> producer: you may publish `credits` more handles on `topic`."""

    topic: Name
    credits: Count


class Deliver(msgspec.Struct, tag="deliver", frozen=True):
    handle: Handle
    attempt: Annotated[int, Meta(ge=1, le=1 << 20)] = 1


class Ack(msgspec.Struct, tag="ack", frozen=True):
    """Consumer -> broker: these deliveries are done. Broker -> producer: these publishes are
    journaled (the producer may forget them; it resends unconfirmed ones after a reconnect)."""

    handle_ids: Names


class Nack(msgspec.Struct, tag="nack", frozen=True):
    """Consumer -> broker: this delivery failed. requeue=False drops it (counted, with reason)."""

    handle_id: Name
    reason: Text
    requeue: bool = True


class Release(msgspec.Struct, tag="release", frozen=True):
    """Broker -> producer: every consumer acked these handles; free their payloads."""

    handle_ids: Names


class Heartbeat(msgspec.Struct, tag="heartbeat", frozen=True):
    state: RunnerState = "running"
    inflight: Count = 0


class Control(msgspec.Struct, tag="control", frozen=True):
    """Control-plane command. target: a stage name, or "*" for every stage.
    version is set for weights_ready."""

    op: ControlOp
    target: Name = "*"
    version: Version = -1


class Stats(msgspec.Struct, tag="stats", frozen=True):
    """Counters of one process (a stage reports its own; the broker answers a stats query with
    its counters plus the last report of every instance, keyed `instance_id.counter`)."""

    source: Name
    counters: Annotated[dict[Text, float], Meta(max_length=65536)]


class Error(msgspec.Struct, tag="error", frozen=True):
    """Broker -> peer: your message was rejected. fatal=True: the handshake failed, give up.
    code: machine-readable kind (malformed, oversize, schema, unknown_peer, bad_topic, ...)."""

    reason: Text
    fatal: bool = False
    code: Name = ""


Message = (
    Hello | Ready | Publish | Request | Deliver | Ack | Nack | Release | Heartbeat | Control | Stats | Error
)


class FieldAt(msgspec.Struct, frozen=True):
    """Where a field's bytes lie in its producer's segment (its Location's segment and offset, and
    its FieldSpec's nbytes: an empty field shares its offset with the next)."""

    segment: Name
    offset: Count
    nbytes: Count


class FetchRequest(msgspec.Struct, tag="fetch", frozen=True):
    handle_id: Name
    fields: Annotated[list[Name], Meta(max_length=256)]
    at: Annotated[list[FieldAt], Meta(max_length=256)] = []
    """Where each of `fields` sits, in order: the producer serves the field it holds there. A joined
    handle's fields are held under the ids of its parts, which its consumers do not know."""


class FetchReply(msgspec.Struct, tag="fetch_reply", frozen=True):
    """Followed by one raw frame per requested field when error is empty."""

    error: Text = ""


class Reclaim(msgspec.Struct, tag="reclaim", frozen=True):
    """Broker -> a host's payload server (`payload/host_server.py`), for producers gone from that
    host: unlink `segments`, and when process `dead_pid` no longer runs there, every other segment
    it created but `keep` (those live handles still point into)."""

    segments: Names = []
    dead_pid: Pid = 0
    keep: Names = []


class ReclaimReply(msgspec.Struct, tag="reclaim_reply", frozen=True):
    """How many segments the host's server unlinked, or why it did nothing."""

    unlinked: Count = 0
    error: Text = ""


PayloadRequest = FetchRequest | Reclaim
"""What a payload server reads."""


class GroupSetup(msgspec.Struct, tag="group_setup", frozen=True):
    """Leader -> the other ranks of its stage instance, after its handshake: the topics it was
    registered with (they set their stage up with them)."""

    inputs: Names = []
    outputs: Names = []


class GroupBatch(msgspec.Struct, tag="group_batch", frozen=True):
    """Leader -> ranks: step on this delivered handle (each rank fetches its payload itself)."""

    handle: Handle


class GroupWeights(msgspec.Struct, tag="group_weights", frozen=True):
    """Leader -> ranks: the broker announced weights of `version`."""

    version: Version


class GroupStop(msgspec.Struct, tag="group_stop", frozen=True):
    """Leader -> ranks: the instance stops; close the stage and exit."""

    reason: Text = ""


GroupMessage = GroupSetup | GroupBatch | GroupWeights | GroupStop


class MessageRejected(ValueError):
    """A frame that is not a well-formed message of this schema. The text says why."""


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)
_payload_request_decoder = msgspec.msgpack.Decoder(PayloadRequest)
_fetch_reply_decoder = msgspec.msgpack.Decoder(FetchReply)
_reclaim_reply_decoder = msgspec.msgpack.Decoder(ReclaimReply)
_group_decoder = msgspec.msgpack.Decoder(GroupMessage)


def encode(message: Message | PayloadRequest | FetchReply | ReclaimReply | GroupMessage) -> bytes:
    return _encoder.encode(message)


def decode(frame: bytes | memoryview) -> Message:
    """Decode one control-plane frame; any malformed or unknown frame raises MessageRejected."""
    try:
        return _decoder.decode(frame)
    except (msgspec.MsgspecError, ValueError) as exc:  # ValueError: e.g. invalid UTF-8 in a str
        raise MessageRejected(f"{type(exc).__name__}: {exc}") from None


def decode_payload_request(frame: bytes | memoryview) -> PayloadRequest:
    try:
        return _payload_request_decoder.decode(frame)
    except (msgspec.MsgspecError, ValueError) as exc:  # ValueError: e.g. invalid UTF-8 in a str
        raise MessageRejected(f"{type(exc).__name__}: {exc}") from None


def decode_fetch_reply(frame: bytes | memoryview) -> FetchReply:
    try:
        return _fetch_reply_decoder.decode(frame)
    except (msgspec.MsgspecError, ValueError) as exc:  # ValueError: e.g. invalid UTF-8 in a str
        raise MessageRejected(f"{type(exc).__name__}: {exc}") from None


def decode_reclaim_reply(frame: bytes | memoryview) -> ReclaimReply:
    try:
        return _reclaim_reply_decoder.decode(frame)
    except (msgspec.MsgspecError, ValueError) as exc:  # ValueError: e.g. invalid UTF-8 in a str
        raise MessageRejected(f"{type(exc).__name__}: {exc}") from None


def decode_group(frame: bytes | memoryview) -> GroupMessage:
    """Decode what a stage instance's leader shared with its other ranks (`stream_rlhf/distributed.py`)."""
    try:
        return _group_decoder.decode(frame)
    except (msgspec.MsgspecError, ValueError) as exc:
        raise MessageRejected(f"{type(exc).__name__}: {exc}") from None
