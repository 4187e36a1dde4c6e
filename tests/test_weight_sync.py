"""Weight sync over broadcast groups: a real sender here, real receivers in spawned processes,
real gloo over loopback."""

from __future__ import annotations

import logging
import threading
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from stream_rlhf.weights.broadcast import BroadcastReceiver, BroadcastSender
from stream_rlhf.weights.buckets import unpack
from stream_rlhf.weights.group import WeightSyncClosed, WeightSyncTimeout, open_group, publish_address, wait_for_address
from stream_rlhf.weights.sender import ServingThreads, SnapshotSlot
from tests.waiting import wait_for
from tests.weight_receiver import receiver_process

pytestmark = pytest.mark.slow

BUCKET_BYTES = 4096


def weights(version: int) -> list[tuple[str, torch.Tensor]]:
    """A small model's worth of mixed tensors whose values say which version they are."""
    torch.manual_seed(version)
    return [
        ("embed.weight", torch.randn(64, 16)),  # 4 KiB: a bucket of its own
        ("layer.0.weight", torch.randn(16, 16).bfloat16()),
        ("layer.0.bias", torch.full((16,), float(version))),
        ("step", torch.tensor([version], dtype=torch.int64)),
    ]


def assert_same(got: dict[str, torch.Tensor], version: int) -> None:
    expected = dict(weights(version))
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name


@pytest.fixture
def sender(tmp_path):
    senders = []

    def make(groups: dict[str, int], timeout_s: float = 20.0, **kwargs) -> BroadcastSender:
        senders.append(BroadcastSender(tmp_path, groups, "gloo", BUCKET_BYTES, timeout_s, **kwargs))
        return senders[-1]

    yield make
    for made in senders:
        made.close()


def test_receiver_gets_the_newest_version_and_waits_for_min_version(tmp_path, sender):
    trainer = sender({"rollout-0": 2})
    trainer.publish(weights(1), version=1)
    with receiver_process(tmp_path, "rollout-0") as receiver:
        receiver.joined()
        receiver.ask()
        version, got = receiver.answer()
        assert version == 1
        assert_same(got, 1)

        trainer.publish(weights(2), version=2)
        trainer.publish(weights(3), version=3)  # before the receiver asks: v2 is never sent
        receiver.ask()
        version, got = receiver.answer()
        assert version == 3
        assert_same(got, 3)

        receiver.ask(min_version=5)
        trainer.publish(weights(4), version=4)
        assert not receiver.answered(within_s=0.5)  # v4 is not enough
        trainer.publish(weights(5), version=5)
        version, got = receiver.answer()
        assert version == 5
        assert_same(got, 5)
    trainer.check()


def test_groups_update_independently(tmp_path, sender):
    trainer = sender({"rollout-0": 2, "rollout-1": 2})
    with receiver_process(tmp_path, "rollout-0") as eager, receiver_process(tmp_path, "rollout-1") as idle:
        eager.joined()
        idle.joined()
        for version in (1, 2, 3):  # rollout-1 never asks meanwhile: nothing waits for it
            trainer.publish(weights(version), version=version)
            eager.ask(min_version=version)
            assert eager.answer()[0] == version
        idle.ask()
        version, got = idle.answer()
        assert version == 3
        assert_same(got, 3)
    trainer.check()


def test_two_receiver_ranks_of_one_group_get_the_same_tensors(tmp_path, sender):
    trainer = sender({"rollout-0": 3})
    trainer.publish(weights(7), version=7)
    with receiver_process(tmp_path, "rollout-0", rank=1, world_size=3) as first, \
            receiver_process(tmp_path, "rollout-0", rank=2, world_size=3) as second:
        first.joined()
        second.joined()
        first.ask()
        second.ask()
        for receiver in (first, second):
            version, got = receiver.answer()
            assert version == 7
            assert_same(got, 7)


def test_a_restarted_receiver_rejoins_its_group_however_its_predecessor_died(tmp_path, sender, caplog):
    """A receiver process killed (1) between two receives, (2) while it waits for a version not
    published yet, (3) before the broadcast of the version it asked for (which then fails): each
    time a new process joins as the same rank and gets the newest version, the other group
    never notices, and the trainer sees no failure."""
    trainer = sender({"rollout-0": 2, "rollout-1": 2})
    trainer.publish(weights(1), version=1)
    with receiver_process(tmp_path, "rollout-1") as other, caplog.at_level(logging.WARNING):
        other.joined()
        for death, version in (("idle", 2), ("waiting", 3), ("before its broadcast", 4)):
            with receiver_process(tmp_path, "rollout-0") as dying:
                dying.joined()
                dying.ask()
                assert dying.answer()[0] == version - 1
                if death != "idle":
                    dying.ask(min_version=version)  # not published yet: the group's thread waits for it
                    assert not dying.answered(within_s=0.3)
                dying.kill()
            if death != "waiting":
                trainer.publish(weights(version), version=version)  # "before its broadcast": sent to the dead rank
            with receiver_process(tmp_path, "rollout-0") as restarted:
                restarted.joined()
                if death == "waiting":
                    trainer.publish(weights(version), version=version)
                restarted.ask(min_version=version)
                got_version, got = restarted.answer()
                assert got_version == version, death
                assert_same(got, version)
            trainer.check()
        other.ask()
        assert other.answer()[0] == 4
    trainer.check()
    reopened = [r.getMessage() for r in caplog.records if "opening it again for the restarted" in r.getMessage()]
    assert len(reopened) == 5, reopened  # every rollout-0 process after the first is a restarted one
    assert "asked to join again (while waiting for a version >= 3)" in reopened[2]
    assert "the broadcast of version 4 failed" in reopened[4] and "Connection closed by peer" in reopened[4]


def group_store(folder, name: str) -> dist.PrefixStore:
    """A client of the store of group `name`'s current opening (what its ranks joined)."""
    host, port = wait_for_address(folder, name, timeout_s=10.0).rsplit(":", 1)
    return dist.PrefixStore(name, dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=10)))


def test_a_receiver_that_died_while_its_group_formed_is_replaced_and_the_group_formed_anew(tmp_path, sender,
                                                                                          caplog):
    """Ranks 1 and 2 of a four-rank group joined, rank 3 was still to come, and rank 1 died: its
    restarted process asks to join again, the sender opens the group anew instead of waiting for
    the dead rank until its timeout, rank 2 (inside the old opening's setup) joins the new one,
    and all three get the weights."""
    trainer = sender({"rollout-0": 4})
    trainer.publish(weights(1), version=1)
    with caplog.at_level(logging.WARNING), \
            receiver_process(tmp_path, "rollout-0", rank=2, world_size=4) as second:
        with receiver_process(tmp_path, "rollout-0", rank=1, world_size=4) as dying:
            store = group_store(tmp_path, "rollout-0")
            wait_for(lambda: store.check(["joined/1", "joined/2"]), 20, "ranks 1 and 2 to join")
            dying.kill()
        with receiver_process(tmp_path, "rollout-0", rank=1, world_size=4) as first:
            wait_for(lambda: "opening it again for the restarted receiver" in caplog.text, 20,
                     "the sender to open the group again")
            with receiver_process(tmp_path, "rollout-0", rank=3, world_size=4) as third:
                for receiver in (first, second, third):
                    receiver.joined()
                    receiver.ask()
                for receiver in (first, second, third):
                    version, got = receiver.answer()
                    assert version == 1
                    assert_same(got, 1)
    trainer.check()


def test_a_waiting_receiver_fails_naming_the_group_when_the_sender_closes(tmp_path):
    trainer = BroadcastSender(tmp_path, {"rollout-0": 2}, "gloo", BUCKET_BYTES, timeout_s=20.0)
    with receiver_process(tmp_path, "rollout-0") as receiver:
        receiver.joined()
        receiver.ask(min_version=1)  # nothing published: it waits
        assert not receiver.answered(within_s=0.3)
        trainer.close()
        assert "group 'rollout-0' at 127.0.0.1:" in receiver.failure()


def test_layout_is_fixed_by_the_first_publish(sender):
    trainer = sender({"rollout-0": 2})
    trainer.publish(weights(1), version=1)
    with pytest.raises(ValueError, match="versions must increase"):
        trainer.publish(weights(1), version=1)
    changed = [(name, t[:2] if name == "embed.weight" else t) for name, t in weights(2)]
    with pytest.raises(ValueError, match=r"'embed.weight' is \(2, 16\) float32; the layout has \(64, 16\)"):
        trainer.publish(changed, version=2)


def test_sender_names_the_rank_that_never_joined(tmp_path):
    """The group's thread gives up after `timeout_s` and `check` then raises naming the rank (that
    the sender waits for ranks that join later is what the tests above rely on)."""
    trainer = BroadcastSender(tmp_path, {"rollout-0": 2}, "gloo", BUCKET_BYTES, timeout_s=1.5,
                              rank_names={"rollout-0": ["trainer", "rollout-0 vLLM worker 0"]})
    message = (r"group 'rollout-0' at 127\.0\.0\.1:\d+: "
               r"rank\(s\) 1 \(rollout-0 vLLM worker 0\) did not join within 1\.5s")
    with pytest.raises(WeightSyncTimeout, match=message):
        wait_for(trainer.check, 120, "the sender to give up on rank 1")
    with pytest.raises(WeightSyncTimeout, match=message):
        trainer.publish(weights(1), version=1)
    trainer.close()  # already reported: closes quietly
    assert not (tmp_path / "rollout-0.json").exists()


@pytest.mark.timeout(120)  # a receiver that ignored its timeout would wait for ever
def test_receiver_without_a_sender_names_the_group(tmp_path):
    with pytest.raises(WeightSyncTimeout, match=r"group 'rollout-9': its address never appeared at .*rollout-9\.json "
                                                r"within 1\.0s"):
        BroadcastReceiver.join(tmp_path, "rollout-9", rank=1, world_size=2, backend="gloo", timeout_s=1.0)


@pytest.mark.timeout(120)  # a rank that ignored its timeout would wait for ever
def test_receiver_names_rank_0_when_its_store_is_gone(tmp_path, free_port):
    publish_address(tmp_path, "rollout-0", f"127.0.0.1:{free_port}")  # an address nobody listens on
    address = wait_for_address(tmp_path, "rollout-0", timeout_s=1.0)
    with pytest.raises(WeightSyncTimeout, match=rf"'rollout-0' at 127\.0\.0\.1:{free_port}: rank 0 \(trainer\) "
                                                r"was not reachable within 1\.0s"):
        open_group(address, 1, 2, "gloo", 1.0, ["trainer", "me"], "rollout-0")


def test_a_snapshot_being_sent_is_never_overwritten_and_an_idle_one_is_reused():
    slot, stop = SnapshotSlot(BUCKET_BYTES), threading.Event()
    slot.publish(weights(1), version=1)
    held = slot.acquire(min_version=1, stop=stop)  # a serving thread is sending v1
    slot.publish(weights(2), version=2)
    assert_same(dict(unpack(held.buckets, slot.layout)), 1)
    slot.release(held)
    newest = slot.acquire(min_version=2, stop=stop)
    slot.release(newest)
    slot.publish(weights(3), version=3)  # nobody sends v2: v3 is packed into its buckets
    newest_again = slot.acquire(min_version=3, stop=stop)
    assert newest_again.buckets[0].data_ptr() == newest.buckets[0].data_ptr()
    assert_same(dict(unpack(newest_again.buckets, slot.layout)), 3)
    stop.set()
    with pytest.raises(WeightSyncClosed, match="waiting for a version >= 4"):
        slot.acquire(min_version=4, stop=stop)


def test_closing_leaves_a_serving_thread_stuck_in_a_transfer_behind_with_a_warning(caplog):
    """A receiver that stopped mid-broadcast holds its group's thread until the collective times
    out; closing waits only the time given, then leaves that (daemon) thread behind."""
    release = threading.Event()
    threads = ServingThreads("weight-sync", lambda name, stop: release.wait(), ["rollout-0"])
    with caplog.at_level(logging.WARNING):
        threads.close(0.2)
    assert "weight-sync rollout-0 still inside a transfer" in caplog.text
    release.set()
