"""TurnOrder: the members of a device group of two ranks take their turns on rank 1 in the order
rank 0 granted them, whatever order rank 1's members ask in; a turn asked for after rank 0 ended
the turns fails instead of waiting forever. Two real processes over gloo."""

from __future__ import annotations

import json
import multiprocessing as mp
import threading
import time
from pathlib import Path

import pytest

from stream_rlhf.distributed import RankGroup, RankSpec
from stream_rlhf.stage import Stage
from stream_rlhf.telemetry.stage_counts import StageCounts
from stream_rlhf.weights.device_turns import DeviceTurns
from stream_rlhf.weights.turn_order import TurnOrder, TurnsEnded

GRANTED = ["a", "b", "b", "a", "b"]
"""The order rank 0 steps its members in."""


def _rank(rank: int, init_method: str, out: str) -> None:
    group = RankGroup.join(RankSpec(rank, 2, init_method, "cpu", timeout_s=60))
    order = TurnOrder(group, ["a", "b"])
    turns = DeviceTurns(order=order)
    for name in ("a", "b"):
        turns.add(name, Stage(), None, StageCounts(Path(out).parent, name, f"{name}-0", write=False))
    taken: list[str] = []
    if rank == 0:
        for name in GRANTED:
            with turns.step(name, None):
                taken.append(name)
        order.close()
    else:
        def member(name: str, delay_s: float) -> None:  # b asks first, a later: rank 0's order wins
            time.sleep(delay_s)
            for _ in range(GRANTED.count(name)):
                with turns.step(name, None):
                    taken.append(name)

        threads = [threading.Thread(target=member, args=(name, delay)) for name, delay in (("b", 0.0), ("a", 0.3))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        try:
            with turns.step("a", None):
                taken.append("a after the end")
        except TurnsEnded as exc:
            taken.append(f"refused: {exc}")
    Path(out).write_text(json.dumps(taken))
    group.close()


@pytest.mark.slow
def test_rank_1_takes_turns_in_rank_0s_order(tmp_path):
    ctx = mp.get_context("spawn")
    init_method = f"file://{tmp_path / 'rendezvous'}"
    outs = [str(tmp_path / f"rank{r}.json") for r in range(2)]
    processes = [ctx.Process(target=_rank, args=(r, init_method, outs[r])) for r in range(2)]
    for process in processes:
        process.start()
    for process in processes:
        process.join(60)
    assert [p.exitcode for p in processes] == [0, 0]
    rank0, rank1 = (json.loads(Path(out).read_text()) for out in outs)
    assert rank0 == GRANTED
    assert rank1[:-1] == GRANTED
    assert rank1[-1] == "refused: a: waited for its turn on rank 1, but rank 0 ended the turns"
