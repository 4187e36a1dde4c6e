"""A stage instance's rank group: sharing the leader's messages, splitting and gathering work."""

from __future__ import annotations

import multiprocessing as mp
import os

import pytest
import torch

from stream_rlhf.broker.control.messages import GroupBatch, GroupSetup, GroupStop, Handle
from stream_rlhf.config import ConfigError
from stream_rlhf.distributed import RankGroup, RankSpec
from stream_rlhf.launch.spec import StageSpec


def _rank(rank: int, init: str, out: mp.Queue) -> None:
    group = RankGroup.join(RankSpec(rank, 2, init))
    try:
        handle = Handle("h1", "rollout", 3, 1, 2, 5, metadata={"references": ["7"]})
        shared = [group.share(m if group.is_leader else None)
                  for m in (GroupSetup(["rollout"], []), GroupBatch(handle), GroupStop("drained"))]
        mine = group.shard(5)
        local = [torch.arange(i + 1, dtype=torch.float32) * (rank + 1) for i in range(mine.start, mine.stop)]
        gathered = group.gather_ragged(local)
        out.put((rank, shared, (mine.start, mine.stop), [t.tolist() for t in gathered], group.sum([1.0, rank]),
                 group.max([float(rank)])))
    finally:
        group.close()
    out.close()
    out.join_thread()
    os._exit(0)  # as a stage process ends (launch/local.py): no interpreter teardown after torch.distributed


@pytest.mark.slow
def test_two_ranks_share_the_leaders_messages_and_gather_in_rank_order(tmp_path):
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, f"file://{tmp_path / 'init'}", out)) for r in range(2)]
    for p in procs:
        p.start()
    results = {r[0]: r[1:] for r in (out.get(timeout=60) for _ in procs)}
    for p in procs:
        p.join(30)
    assert [p.exitcode for p in procs] == [0, 0]
    for rank in (0, 1):
        shared, mine, gathered, total, top = results[rank]
        assert shared[0] == GroupSetup(["rollout"], []) and shared[2] == GroupStop("drained")
        assert shared[1].handle.iteration == 3 and shared[1].handle.metadata == {"references": ["7"]}
        assert mine == ((0, 3), (3, 5))[rank]  # the first rank takes the odd one
        # rank 0 computed samples 0..2 (x1), rank 1 samples 3..4 (x2): one list, in sample order
        assert gathered == [[0.0], [0.0, 1.0], [0.0, 1.0, 2.0], [0.0, 2.0, 4.0, 6.0], [0.0, 2.0, 4.0, 6.0, 8.0]]
        assert total == [2.0, 1.0] and top == [1.0]


def test_a_single_rank_group_needs_nothing_and_shards_everything():
    group = RankGroup.join(RankSpec())
    assert not group.distributed and group.is_leader and group.shard(7) == slice(0, 7)
    assert group.share(GroupStop()) == GroupStop()
    assert group.gather_ragged([torch.ones(2)])[0].tolist() == [1.0, 1.0]


def test_rank_specs_and_stage_specs_refuse_what_cannot_run():
    with pytest.raises(ValueError, match="rank=2: must be in"):
        RankSpec(rank=2, world_size=2, init_method="file:///tmp/x")
    with pytest.raises(ValueError, match="needs an init_method"):
        RankSpec(rank=0, world_size=2)
    with pytest.raises(ConfigError, match="devices=\\['cpu'\\]: one entry per rank, 2 rank"):
        StageSpec("m:C", ranks=2, devices=["cpu"])
    with pytest.raises(ConfigError, match="ranks=0: must be >= 1"):
        StageSpec("m:C", ranks=0)
