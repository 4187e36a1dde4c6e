"""At a stop the trainers catch up with each other before any stage is told to shut down
(`broker/control/catch_up.py`), driven on the broker's core without sockets."""

from __future__ import annotations

import logging

import pytest

from stream_rlhf.broker.control.messages import Ack, Control, Deliver, Heartbeat, Nack, Request
from stream_rlhf.broker.control.topology import CONTROL_STAGE, TopicConfig, Topology
from stream_rlhf.config import ConfigError
from tests.test_core import Harness

TRAINERS = Topology({
    "experience": TopicConfig(producers=["src"], consumers=["actor", "critic", "heads"],
                              align_at_stop=["actor", "critic"]),
})


def job() -> tuple[Harness, bytes, bytes, bytes, bytes]:
    h = Harness(topology=TRAINERS)
    src = h.join("src", "src-0")
    actor = h.join("actor", "actor-0", {"experience": 4})
    critic = h.join("critic", "critic-0", {"experience": 1})
    heads = h.join("heads", "heads-0", {"experience": 4})
    return h, src, actor, critic, heads


def stop(h: Harness) -> None:
    h.send(h.join(CONTROL_STAGE, "ctl"), Control("shutdown"))


def shutdowns(h: Harness, *peers: bytes) -> list[bytes]:
    return [p for p in peers if any(isinstance(m, Control) and m.op == "shutdown" for m in h.take(p))]


def test_a_trainer_behind_gets_what_the_other_acked_and_only_then_every_stage_hears_of_the_stop():
    h, src, actor, critic, heads = job()
    for k in range(3):  # mini-batches 0 and 1 of iteration 0, then 0 of iteration 1
        h.publish(src, "experience", f"x{k}", iteration=k // 2, minibatch=k % 2)
    h.send(actor, Ack(["x0", "x1", "x2"]))  # the actor trained iteration 0 and holds half of 1
    assert [d.handle.id for d in h.take(critic, Deliver)] == ["x0"]  # one credit: x1 and x2 wait
    h.send(critic, Ack(["x0"]))
    h.take(src), h.take(heads)
    stop(h)
    assert shutdowns(h, src, actor, critic, heads) == []
    assert "critic lacks 2 of 2" in h.core.catch_up.describe()
    h.send(critic, Request("experience", 4))
    assert [d.handle.id for d in h.take(critic, Deliver)] == ["x1", "x2"]  # only what the actor acked
    h.publish(src, "experience", "x3", iteration=1, minibatch=1)  # a producer's last step still lands
    h.send(actor, Request("experience", 4))
    assert h.take(actor, Deliver) == [] and h.take(src, Request) == []  # nothing new, no producer credit
    h.send(critic, Ack(["x1"]))
    assert shutdowns(h, src, actor, critic, heads) == []
    h.send(critic, Ack(["x2"]))
    assert shutdowns(h, src, actor, critic, heads) == [src, actor, critic, heads]


def test_a_delivery_a_trainer_still_holds_is_waited_for_and_then_caught_up_by_the_other():
    h, src, actor, critic, heads = job()
    h.publish(src, "experience", "x0")
    h.take(actor), h.take(critic)
    stop(h)  # each holds x0 unacknowledged: acking it later puts the other behind
    assert shutdowns(h, src, actor, critic, heads) == []
    h.send(actor, Ack(["x0"]))
    assert shutdowns(h, actor, critic) == [] and h.core.catch_up.lacks == {"critic": {"x0"}}
    h.send(critic, Nack("x0", "busy", requeue=True))  # back to its queue, delivered again: it lacks it
    h.send(critic, Request("experience", 1))
    assert [d.handle.id for d in h.take(critic, Deliver)] == ["x0"]
    h.send(critic, Ack(["x0"]))
    assert shutdowns(h, src, actor, critic, heads) == [src, actor, critic, heads]


def test_what_a_sibling_acks_during_the_catch_up_goes_to_a_trainer_idle_with_credit():
    h, src, actor, critic, heads = job()
    h.publish(src, "experience", "x0")
    h.take(critic)
    h.send(critic, Ack(["x0"]))
    h.publish(src, "experience", "x1")  # the actor holds it; the critic, out of credit, does not
    stop(h)
    h.send(critic, Request("experience", 1))  # nothing it lacks yet: the credit waits
    assert h.take(critic, Deliver) == []
    h.send(actor, Ack(["x0", "x1"]))
    assert [d.handle.id for d in h.take(critic, Deliver)] == ["x1"]
    h.send(critic, Ack(["x1"]))
    assert shutdowns(h, src, actor, critic, heads) == [src, actor, critic, heads]


def test_trainers_level_with_each_other_hear_of_the_stop_at_once():
    h, src, actor, critic, heads = job()
    h.publish(src, "experience", "x0")
    h.take(actor), h.take(critic)
    h.send(actor, Ack(["x0"]))
    h.send(critic, Ack(["x0"]))  # heads (not aligned) still holds it: that does not matter
    stop(h)
    assert shutdowns(h, src, actor, critic, heads) == [src, actor, critic, heads]


def test_a_trainer_behind_that_leaves_ends_the_catch_up():
    h, src, actor, critic, heads = job()
    h.publish(src, "experience", "x0")
    h.publish(src, "experience", "x1")
    h.send(actor, Ack(["x0", "x1"]))
    h.take(critic)
    h.send(critic, Ack(["x0"]))
    stop(h)
    assert shutdowns(h, src, actor, critic, heads) == []
    h.send(critic, Heartbeat("stopped"))
    assert shutdowns(h, src, actor, heads) == [src, actor, heads]


def test_end_catch_up_shuts_down_without_the_trainer_behind_and_says_so(caplog):
    h, src, actor, critic, heads = job()
    h.publish(src, "experience", "x0")
    h.publish(src, "experience", "x1")
    h.send(actor, Ack(["x0", "x1"]))
    h.take(critic)
    stop(h)
    with caplog.at_level(logging.WARNING):
        h.core.end_catch_up()
    assert "critic lacks 2 of 2" in caplog.text and "critic-0: 1" in caplog.text  # x0 it holds, x1 queued
    told = {peer for peer, m in h.core.flush() if isinstance(m, Control) and m.op == "shutdown"}
    assert told == {src, actor, critic, heads}


def test_only_consumers_can_be_aligned():
    with pytest.raises(ConfigError, match=r"align_at_stop=\['critic'\]: only consumers \(\['actor'\]\)"):
        TopicConfig(producers=["src"], consumers=["actor"], align_at_stop=["critic"])
