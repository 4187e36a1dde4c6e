"""Core lending: the board every stage process maps, the thread governor's hooks, and which
stages of a dataflow take part."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from stream_rlhf.backends.core_board import CoreBoard, CoreLending
from stream_rlhf.backends.core_lending import ThreadGovernor, govern
from stream_rlhf.config import build
from stream_rlhf.driver.dataflow import compile_job
from stream_rlhf.rl.config import RLJobConfig
from tests.rl_tiny import tiny_job


def test_the_board_is_shared_through_its_file_and_names_bad_slots(tmp_path):
    path = str(tmp_path / "board")
    one, other = CoreBoard(path, 4), CoreBoard(path, 4)
    one.set(2, True)
    assert other.any_busy((2,)) and not other.any_busy((0, 1, 3))
    one.set(2, False)
    assert not other.any_busy((0, 1, 2, 3))
    with pytest.raises(ValueError, match=r"first_slot=4: must lie in \[0, slots=4\)"):
        CoreLending(path, 4, 4, (0,))


class ProbeDecoderLayer(nn.Module):
    """Records torch's thread count in its forward and in its backward."""

    def __init__(self, seen: list[tuple[str, int]], width: int):
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.seen = seen

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(("forward", torch.get_num_threads()))
        x = x.clone().requires_grad_()
        x.register_hook(lambda grad: self.seen.append(("backward", torch.get_num_threads())))
        return self.linear(x)


class ThreadProbe(nn.Module):
    def __init__(self, width: int = 2048):  # 4.2M parameters: big enough to borrow for
        super().__init__()
        self.seen: list[tuple[str, int]] = []
        self.layer = ProbeDecoderLayer(self.seen, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)


@pytest.fixture
def governor(tmp_path):
    if not {0, 1} <= os.sched_getaffinity(0):
        pytest.skip("lending core 0 to core 1 needs both cores")
    affinity, threads = os.sched_getaffinity(0), torch.get_num_threads()
    lending = CoreLending(str(tmp_path / "board"), slots=3, first_slot=1, lender_cores=(0,))
    governor = ThreadGovernor(lending, instance_index=0, own_cores=[1])
    governor.install()
    yield governor
    governor.close()
    os.sched_setaffinity(0, affinity)
    torch.set_num_threads(threads)


def test_threads_follow_the_other_steps_from_module_to_module(governor):
    """Own core while another instance steps, own + lender's while this one steps alone,
    switching inside a step: in the forward, before each backward and before the optimizer step."""
    lender = CoreBoard(governor.lending.board, governor.lending.slots)
    probe = ThreadProbe()
    govern(probe)  # hooks the decoder layer
    optimizer = torch.optim.SGD(probe.parameters(), lr=0.1)
    optimizer.register_step_pre_hook(lambda *args: probe.seen.append(("step", torch.get_num_threads())))
    assert os.sched_getaffinity(0) == {1}  # its own core until it borrows
    lender.set(0, True)
    with governor.busy():
        assert lender.any_busy((1,))  # this instance is marked busy while it steps
        loss = probe(torch.ones(2, 2048)).sum()
        lender.set(0, False)  # the lender finishes while this step runs
        loss.backward()
        optimizer.step()
    assert not lender.any_busy((1,))
    assert probe.seen == [("forward", 1), ("backward", 2), ("step", 2)]
    assert os.sched_getaffinity(0) == {0, 1}  # the lender's core too, while borrowing
    lender.set(0, True)
    with governor.busy():
        probe(torch.ones(2, 2048))
    assert probe.seen[-1] == ("forward", 1) and os.sched_getaffinity(0) == {1}
    lender.set(0, False)
    lender.set(2, True)  # another stage of this side steps: two processes must not both take two threads
    with governor.busy():
        probe(torch.ones(2, 2048))
    assert probe.seen[-1] == ("forward", 1)
    assert governor.borrowed == 1


def test_a_stage_with_only_small_models_never_borrows(governor):
    probe = ThreadProbe(width=4)
    govern(probe)
    with governor.busy():  # alone on the board
        probe(torch.ones(2, 4))
    assert probe.seen == [("forward", 1)] and governor.borrowed == 0


def test_a_separated_cpu_placement_lends_idle_cores_between_the_two_sides(tmp_path):
    data = tiny_job(tmp_path, "lend", placement={"mode": "separated", "rollout_cores": [0], "train_cores": [1],
                                                 "device": "cpu"})
    flow = compile_job(build(RLJobConfig, data), "c", "w")
    lending = {name: spec.lending for name, spec in flow.stages.items()}
    assert lending["prompts"] is None  # no model: nothing to borrow for
    rollout, train = lending["rollout"], lending["actor_train"]
    assert rollout.lender_cores == (1,) and train.lender_cores == (0,)
    assert sorted(spec.first_slot for spec in lending.values() if spec) == list(range(len(flow.stages) - 1))
    assert rollout.slots == len(flow.stages) - 1
    assert rollout.board == str(tmp_path / "lend" / "core_board")
    for change in ({"lend_idle_cores": False}, {"mode": "colocated"}):
        off = tiny_job(tmp_path, "off", placement={**data["placement"], **change})
        assert all(spec.lending is None for spec in compile_job(build(RLJobConfig, off), "c", "w").stages.values())
    grouped = tiny_job(tmp_path, "g",
                       placement={**data["placement"], "stages": {"actor_train": {"ranks": 1, "cores": [0, 1]}}})
    assert compile_job(build(RLJobConfig, grouped), "c", "w").stages["actor_train"].lending is None  # its own cores
