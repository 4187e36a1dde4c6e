"""Broker logic without sockets: fan-out, competition, joins, credit, redelivery, journal."""

from __future__ import annotations

import pytest

from stream_rlhf.broker.control.admission import OverlapAdmission
from stream_rlhf.broker.control.core import BrokerCore
from stream_rlhf.broker.control.messages import (
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
    Nack,
    Publish,
    Ready,
    Reclaim,
    Release,
    Request,
)
from stream_rlhf.broker.control.topology import BrokerConfig, TopicConfig, Topology
from stream_rlhf.broker.payload.memory_transport import MemoryTransport
from stream_rlhf.broker.runtime.host import StageHost
from stream_rlhf.config import ConfigError
from stream_rlhf.stage import Output, Stage

TOPOLOGY = Topology({
    "prompts": TopicConfig(producers=["src"], consumers=["rollout"]),
    "rollout": TopicConfig(producers=["rollout"], consumers=["ref", "reward"]),
    "ref_logp": TopicConfig(producers=["ref"]),
    "reward": TopicConfig(producers=["reward"]),
    "experience": TopicConfig(join=["rollout", "ref_logp", "reward"], consumers=["train"]),
})


class Harness:
    def __init__(self, config: BrokerConfig | None = None, admission=None, topology=TOPOLOGY):
        self.now = 0.0
        self.core = BrokerCore(topology, config or BrokerConfig(queue_capacity=4), self.now, admission)
        self.inbox: dict[bytes, list] = {}

    def join(self, stage: str, instance: str, credits: dict[str, int] | None = None) -> bytes:
        peer = instance.encode()
        self.send(peer, Hello(SCHEMA_VERSION, stage, instance))
        for topic, n in (credits or {}).items():
            self.send(peer, Request(topic, n))
        return peer

    def send(self, peer: bytes, message) -> None:
        self.core.handle(peer, message, self.now)
        for to, out in self.core.flush():
            self.inbox.setdefault(to, []).append(out)

    def take(self, peer: bytes, kind=None) -> list:
        got = self.inbox.pop(peer, [])
        return [m for m in got if kind is None or isinstance(m, kind)]

    def publish(self, peer: bytes, topic: str, hid: str, iteration=0, minibatch=0, **kw) -> None:
        self.send(peer, Publish(Handle(hid, topic, iteration, minibatch, 0, 1, **kw)))


def test_fan_out_to_every_consumer_stage_and_release_after_all_acks():
    h = Harness()
    roll = h.join("rollout", "roll-0")
    ref = h.join("ref", "ref-0", {"rollout": 4})
    rew = h.join("reward", "rew-0", {"rollout": 4})
    h.publish(roll, "rollout", "a")
    assert [d.handle.id for d in h.take(ref, Deliver)] == ["a"]
    assert [d.handle.id for d in h.take(rew, Deliver)] == ["a"]
    assert h.take(roll, Ack)[0].handle_ids == ["a"]  # publish confirmed
    h.send(ref, Ack(["a"]))
    assert h.take(roll, Release) == []  # reward and the join still hold it
    h.send(rew, Ack(["a"]))
    assert h.take(roll, Release) == []  # the join waits for ref_logp and reward parts


def test_competing_instances_least_loaded_first():
    h = Harness(BrokerConfig(queue_capacity=16))
    src = h.join("src", "src-0")
    r0 = h.join("rollout", "roll-0", {"prompts": 10})
    r1 = h.join("rollout", "roll-1", {"prompts": 10})
    for i in range(6):
        h.publish(src, "prompts", f"p{i}")
    d0, d1 = h.take(r0, Deliver), h.take(r1, Deliver)
    assert len(d0) == 3 and len(d1) == 3
    assert {d.handle.id for d in d0} | {d.handle.id for d in d1} == {f"p{i}" for i in range(6)}
    h.send(r0, Ack([d.handle.id for d in d0]))  # roll-0 is now idle, roll-1 has 3 in flight
    h.publish(src, "prompts", "p6")
    h.publish(src, "prompts", "p7")
    assert len(h.take(r0, Deliver)) == 2 and h.take(r1, Deliver) == []


def test_join_merges_parts_by_minibatch_and_releases_parts_when_joined_is_acked():
    h = Harness()
    roll = h.join("rollout", "roll-0")
    ref = h.join("ref", "ref-0", {"rollout": 4})
    rew = h.join("reward", "rew-0", {"rollout": 4})
    train = h.join("train", "train-0", {"experience": 4})
    h.publish(roll, "rollout", "r1", iteration=0, minibatch=1, fields={}, metadata={"a": 1})
    h.publish(roll, "rollout", "r2", iteration=0, minibatch=2)
    h.publish(ref, "ref_logp", "f2", iteration=0, minibatch=2)
    h.publish(rew, "reward", "w2", iteration=0, minibatch=2)
    assert h.take(train, Deliver)[0].handle.parents == ["r2", "f2", "w2"]
    h.publish(ref, "ref_logp", "f1", iteration=0, minibatch=1)
    assert h.take(train, Deliver) == []
    h.publish(rew, "reward", "w1", iteration=0, minibatch=1)
    (joined,) = h.take(train, Deliver)
    assert (joined.handle.topic, joined.handle.minibatch, joined.handle.metadata) == ("experience", 1, {"a": 1})
    h.take(roll), h.take(ref), h.take(rew)
    h.send(ref, Ack(["r1"]))
    h.send(rew, Ack(["r1"]))
    h.send(train, Ack([joined.handle.id]))
    assert h.take(roll, Release)[0].handle_ids == ["r1"]
    assert h.take(ref, Release)[0].handle_ids == ["f1"]
    assert h.take(rew, Release)[0].handle_ids == ["w1"]


def test_producer_credit_bounded_by_queue_capacity():
    h = Harness(BrokerConfig(queue_capacity=4))
    src = h.join("src", "src-0")
    assert sum(r.credits for r in h.take(src, Request)) == 4
    for i in range(4):
        h.publish(src, "prompts", f"p{i}")
    assert h.take(src, Request) == []  # queue full, no consumer: no more credit
    roll = h.join("rollout", "roll-0", {"prompts": 1})
    assert len(h.take(roll, Deliver)) == 1
    assert sum(r.credits for r in h.take(src, Request)) == 1  # one left the queue, one more allowed


def test_topic_capacity_bounds_its_producer_by_the_consumer_queue_alone():
    """A vision-like topic: consumed by rollout and also a join part. Its own capacity (the
    prefetch depth) counts only what waits for rollout, not what waits in the join."""
    topology = Topology({
        "vision": TopicConfig(producers=["enc"], consumers=["rollout"], capacity=2),
        "rollout": TopicConfig(producers=["rollout"], consumers=["ref"]),
        "ref_logp": TopicConfig(producers=["ref"]),
        "experience": TopicConfig(join=["vision", "rollout", "ref_logp"], consumers=["train"]),
    })
    h = Harness(BrokerConfig(queue_capacity=16), topology=topology)
    enc = h.join("enc", "enc-0")
    assert sum(r.credits for r in h.take(enc, Request)) == 2
    h.publish(enc, "vision", "v0", minibatch=0)
    h.publish(enc, "vision", "v1", minibatch=1)
    assert h.take(enc, Request) == []  # two encoded ahead: the depth is reached
    roll = h.join("rollout", "roll-0", {"vision": 1})
    assert [d.handle.id for d in h.take(roll, Deliver)] == ["v0"]
    h.send(roll, Ack(["v0"]))
    # v0 still waits in the experience join, but rollout took it: one more may be encoded
    assert sum(r.credits for r in h.take(enc, Request)) == 1


def test_topic_capacity_needs_consumers():
    with pytest.raises(ConfigError, match="capacity=2"):
        TopicConfig(producers=["enc"], capacity=2)


def test_dead_instance_handles_are_redelivered_to_a_live_one():
    h = Harness(BrokerConfig(queue_capacity=8, heartbeat_interval_s=0.5, heartbeat_timeout_s=2.0))
    src = h.join("src", "src-0")
    r0 = h.join("rollout", "roll-0", {"prompts": 2})
    for i in range(2):
        h.publish(src, "prompts", f"p{i}")
    assert len(h.take(r0, Deliver)) == 2
    r1 = h.join("rollout", "roll-1", {"prompts": 4})
    h.now = 1.5
    h.send(r1, Heartbeat())
    h.send(src, Heartbeat())
    h.now = 2.6
    h.core.tick(h.now)  # roll-0 silent for 2.6 s
    for to, out in h.core.flush():
        h.inbox.setdefault(to, []).append(out)
    redelivered = h.take(r1, Deliver)
    assert [(d.handle.id, d.attempt) for d in redelivered] == [("p0", 2), ("p1", 2)]
    assert h.core.stats["redelivered"] == 2


def test_what_a_producer_gone_from_another_host_left_is_asked_of_that_hosts_payload_server():
    """The broker cannot unlink segments on another host: it queues Reclaims for the payload server
    the producer's Hello named, first for the dead process (but what its live handles point into),
    then for each handle once acknowledged. Its own host's counter does not move."""
    h = Harness(BrokerConfig(queue_capacity=8, shm_prefix="job", heartbeat_interval_s=0.5, heartbeat_timeout_s=2.0))
    h.core.host = "broker-host"
    server = "tcp://10.0.0.6:5123"
    src = b"src-0"
    h.send(src, Hello(SCHEMA_VERSION, "src", "src-0", [], 4242, "host-b", server))
    roll = h.join("rollout", "roll-0", {"prompts": 2})
    for i in (1, 2):
        where = Location("shm", f"/job_4242_{i}", 0, "host-b", server)
        h.publish(src, "prompts", f"p{i}", fields={"x": FieldSpec("float32", [4], 16, where)})
    assert len(h.take(roll, Deliver)) == 2
    h.now = 1.5
    h.send(roll, Heartbeat())
    h.now = 2.6
    h.core.tick(h.now)  # src silent for 2.6 s
    assert h.core.reclaims == [(server, Reclaim(dead_pid=4242, keep=["/job_4242_1", "/job_4242_2"]))]
    h.core.reclaims.clear()
    h.send(roll, Ack(["p1"]))
    assert h.core.reclaims == [(server, Reclaim(segments=["/job_4242_1"]))]
    assert h.core.stats["segments_reclaimed"] == 0


def test_nack_requeues_then_drops_poison_after_max_attempts():
    h = Harness(BrokerConfig(queue_capacity=8, max_attempts=2))
    src = h.join("src", "src-0")
    roll = h.join("rollout", "roll-0", {"prompts": 5})
    h.publish(src, "prompts", "p0")
    for _ in range(2):
        assert len(h.take(roll, Deliver)) == 1
        h.send(roll, Nack("p0", "boom"))
    assert h.take(roll, Deliver) == []
    assert h.core.stats["dropped.poison"] == 1
    assert h.take(src, Release)[0].handle_ids == ["p0"]


def test_duplicate_publish_is_acked_and_dropped():
    h = Harness()
    src = h.join("src", "src-0")
    roll = h.join("rollout", "roll-0", {"prompts": 5})
    h.publish(src, "prompts", "p0")
    h.publish(src, "prompts", "p0")  # a resend after a reconnect
    assert len(h.take(roll, Deliver)) == 1
    assert h.core.stats["duplicate_publishes"] == 1


def test_publish_without_credit_is_rejected_not_queued_and_its_payload_released():
    h = Harness(BrokerConfig(queue_capacity=4))
    src = h.join("src", "src-0")
    assert sum(r.credits for r in h.take(src, Request)) == 4
    for i in range(5):
        h.publish(src, "prompts", f"p{i}")
    replies = h.take(src)
    (error,) = [m for m in replies if isinstance(m, Error)]
    assert error.code == "no_credit" and "p4" in error.reason and not error.fatal
    assert [m.handle_ids for m in replies if isinstance(m, Release)] == [["p4"]]  # the producer frees it
    assert h.core.stats["rejected.no_credit"] == 1 and h.core.stats["published"] == 4
    assert list(h.core.queues[("prompts", "rollout")]) == ["p0", "p1", "p2", "p3"]
    h.publish(src, "prompts", "p0")  # a resend of what it has: acked again, nothing queued
    assert [type(m) for m in h.take(src)] == [Ack] and len(h.core.queues[("prompts", "rollout")]) == 4


class ThreePrompts(Stage):
    def step(self, batch):
        return [Output("prompts", {}, num_samples=1, iteration=0, minibatch=i) for i in range(3)]


def test_a_resend_after_a_handshake_waits_for_the_new_credit():
    """A producer that says hello again resends what was never confirmed; each resend spends one
    credit of the new handshake, as the broker counts it, so none is rejected."""
    h = Harness(BrokerConfig(queue_capacity=4))
    src = h.join("src", "src-0")
    outbox: list = []
    host = StageHost(ThreePrompts(), "src", "src-0", MemoryTransport(), outbox.append)
    host.on_ready(Ready(SCHEMA_VERSION, "b", 1.0, 1 << 20, [], ["prompts"]))
    host.on_producer_credit(h.take(src, Request)[0])
    host.produce()
    assert len(outbox) == 3  # not confirmed: the broker restarted before it read them
    h2 = Harness(BrokerConfig(queue_capacity=4))
    src2 = h2.join("src", "src-0")
    host.on_ready(Ready(SCHEMA_VERSION, "b", 1.0, 1 << 20, [], ["prompts"]))
    outbox.clear()
    (grant,) = h2.take(src2, Request)
    host.on_producer_credit(Request("prompts", 2))  # part of it: two resends go out
    assert len(outbox) == 2
    host.on_producer_credit(Request("prompts", grant.credits - 2))
    for publish in outbox:
        h2.send(src2, publish)
    assert h2.core.stats["published"] == 3 and h2.core.stats["rejected"] == 0


def test_overlap_admission_bounds_how_far_rollout_runs_ahead():
    h = Harness(BrokerConfig(queue_capacity=8), admission=OverlapAdmission(frozenset({"prompts"}), 1))
    src = h.join("src", "src-0")
    roll = h.join("rollout", "roll-0", {"prompts": 8})
    for it in range(4):
        h.publish(src, "prompts", f"p{it}", iteration=it)
    assert [d.handle.iteration for d in h.take(roll, Deliver)] == [0, 1]  # policy v0, depth 1
    h.send(src, Control("weights_ready", "*", 1))
    assert [d.handle.iteration for d in h.take(roll, Deliver)] == [2]
    h.send(src, Control("weights_ready", "*", 2))
    assert [d.handle.iteration for d in h.take(roll, Deliver)] == [3]


def test_bad_messages_are_rejected_and_counted_not_fatal():
    h = Harness()
    h.send(b"stranger", Ack(["x"]))
    assert h.take(b"stranger", Error)[0].code == "unknown_peer"
    h.send(b"old", Hello(SCHEMA_VERSION + 1, "src", "old"))
    assert h.take(b"old", Error)[0].fatal
    h.send(b"who", Hello(SCHEMA_VERSION, "nobody", "who"))
    assert "not in the topology" in h.take(b"who", Error)[0].reason
    src = h.join("src", "src-0")
    h.publish(src, "reward", "x")  # src does not produce reward
    assert h.take(src, Error)[0].code == "bad_topic"
    h.send(src, Ready(SCHEMA_VERSION, "b", 1.0, 1))
    assert h.take(src, Error)[0].code == "unexpected_type"
    assert h.core.stats["rejected"] == 5


def test_journal_replay_restores_queues_and_join_partials(tmp_path):
    config = BrokerConfig(queue_capacity=8, journal=str(tmp_path / "j"))
    h = Harness(config)
    roll = h.join("rollout", "roll-0")
    ref = h.join("ref", "ref-0", {"rollout": 4})
    h.join("reward", "rew-0", {"rollout": 4})
    h.publish(roll, "rollout", "r0", minibatch=0)
    h.publish(roll, "rollout", "r1", minibatch=1)
    h.send(ref, Ack(["r0"]))
    h.publish(ref, "ref_logp", "f1", minibatch=1)
    h.core.journal.flush()
    # the broker dies here; a new one replays the journal
    h2 = Harness(config)
    assert set(h2.core.entries) == {"r0", "r1", "f1"}
    assert list(h2.core.queues[("rollout", "ref")]) == ["r1"]  # r0 was acked by ref
    assert list(h2.core.queues[("rollout", "reward")]) == ["r0", "r1"]
    rew = h2.join("reward", "rew-0", {"rollout": 4})
    train = h2.join("train", "train-0", {"experience": 4})
    h2.publish(rew, "reward", "w1", minibatch=1)
    (joined,) = h2.take(train, Deliver)
    assert joined.handle.parents == ["r1", "f1", "w1"]


def test_pause_holds_deliveries_until_resume_and_is_forwarded_to_the_stage():
    h = Harness()
    src = h.join("src", "src-0")
    roll = h.join("rollout", "roll-0", {"prompts": 4})
    h.send(src, Control("pause", "rollout"))
    assert [c.op for c in h.take(roll, Control)] == ["pause"]
    h.publish(src, "prompts", "p0")
    assert h.take(roll, Deliver) == []
    h.send(src, Control("resume", "rollout"))
    assert [d.handle.id for d in h.take(roll, Deliver)] == ["p0"]


def test_draining_instance_gets_nothing_more_and_its_nacks_go_elsewhere():
    h = Harness()
    src = h.join("src", "src-0")
    r0 = h.join("rollout", "roll-0", {"prompts": 4})
    h.publish(src, "prompts", "p0")
    assert len(h.take(r0, Deliver)) == 1
    r1 = h.join("rollout", "roll-1", {"prompts": 4})
    h.send(r0, Heartbeat("draining"))
    h.send(r0, Nack("p0", "roll-0 is draining"))
    h.publish(src, "prompts", "p1")
    assert h.take(r0, Deliver) == []
    assert [d.handle.id for d in h.take(r1, Deliver)] == ["p0", "p1"]


def test_join_completion_returns_producer_credit_to_the_parts():
    topology = Topology({
        "a": TopicConfig(producers=["pa"]),
        "b": TopicConfig(producers=["pb"]),
        "ab": TopicConfig(join=["a", "b"], consumers=["sink"]),
    })
    h = Harness(BrokerConfig(queue_capacity=2), topology=topology)
    pa, pb = h.join("pa", "pa-0"), h.join("pb", "pb-0")
    h.join("sink", "sink-0", {"ab": 10})
    assert sum(r.credits for r in h.take(pa, Request)) == 2
    h.publish(pa, "a", "a0", minibatch=0)
    h.publish(pa, "a", "a1", minibatch=1)  # two parts wait for b: a's producer is out of credit
    assert h.take(pa, Request) == []
    h.publish(pb, "b", "b0", minibatch=0)
    h.publish(pb, "b", "b1", minibatch=1)  # both joins complete: nothing waits any more
    assert sum(r.credits for r in h.take(pa, Request)) == 2


def credit(h: Harness, peer: bytes, topic: str) -> int:
    """The producer credit on `topic` granted to `peer` since the last look (other messages stay)."""
    grants = [m for m in h.inbox.get(peer, []) if isinstance(m, Request) and m.topic == topic]
    h.inbox[peer] = [m for m in h.inbox.get(peer, []) if m not in grants]
    return sum(r.credits for r in grants)


def test_a_rollout_instance_that_says_hello_second_gets_credit_while_the_first_holds_it():
    """The two-rollout-instance deadlock of the vLLM broadcast job: the first instance to say hello
    took the whole capacity; the second, holding mini-batch 1 of iteration 0, waited for credit
    forever: iteration 0 never trained, so the first got no prompts of iteration 1 to publish."""
    h = Harness(BrokerConfig(queue_capacity=16), admission=OverlapAdmission(frozenset({"prompts"}), 0))
    src = h.join("src", "src-0")
    for it, mb in [(0, 0), (0, 1), (1, 0), (1, 1)]:
        h.publish(src, "prompts", f"p{it}{mb}", iteration=it, minibatch=mb)
    first = h.join("rollout", "rollout-1", {"prompts": 1})
    assert credit(h, first, "rollout") == 16  # alone: the whole capacity
    second = h.join("rollout", "rollout-0", {"prompts": 1})
    assert credit(h, second, "rollout") == 8  # its share, although the first holds all 16
    ref, rew = h.join("ref", "ref-0", {"rollout": 4}), h.join("reward", "rew-0", {"rollout": 4})
    train = h.join("train", "train-0", {"experience": 4})
    for peer, mb in [(first, 0), (second, 1)]:
        assert [d.handle.id for d in h.take(peer, Deliver)] == [f"p0{mb}"]
        h.publish(peer, "rollout", f"r0{mb}", minibatch=mb)
        h.publish(ref, "ref_logp", f"l0{mb}", minibatch=mb)
        h.publish(rew, "reward", f"w0{mb}", minibatch=mb)
        h.send(peer, Ack([f"p0{mb}"]))
    assert h.take(first, Deliver) == []  # iteration 1 waits for the weights iteration 0 trains
    assert [d.handle.minibatch for d in h.take(train, Deliver)] == [0, 1]  # iteration 0 is whole
    assert h.core.stats["rejected.no_credit"] == 0


def test_a_producer_out_of_credit_gets_the_free_room_even_below_a_chunk():
    """Credit goes out in chunks (capacity // 4) while every producer holds some; one that has
    none may be waiting for it, and its idle peers may never use theirs."""
    h = Harness(BrokerConfig(queue_capacity=8))  # chunks of 2; 8 producers: a share of 1 each
    peers = [f"src-{i}".encode() for i in range(8)]
    for peer in peers[:-1]:  # all say hello in one turn of the broker
        h.core.handle(peer, Hello(SCHEMA_VERSION, "src", peer.decode()), h.now)
    last = h.join("src", "src-7")
    assert [credit(h, p, "prompts") for p in peers] == [1] * 8
    h.publish(last, "prompts", "p0")
    assert credit(h, last, "prompts") == 0  # its one handle fills the capacity with its peers' shares
    roll = h.join("rollout", "roll-0", {"prompts": 1})
    assert [d.handle.id for d in h.take(roll, Deliver)] == ["p0"]
    assert credit(h, last, "prompts") == 1  # the room p0 left, less than a chunk
