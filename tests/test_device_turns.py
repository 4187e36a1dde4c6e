"""DeviceTurns: stages of one process take turns on its device, moving what their offload policies
name, at the moments they name; on CUDA the round trip is exact and the device memory really leaves."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from stream_rlhf.backends.optimizer_config import OptimizerConfig
from stream_rlhf.backends.torch_engine import TorchTrainEngine
from stream_rlhf.broker.control.messages import Handle
from stream_rlhf.distributed import RankGroup
from stream_rlhf.stage import Batch, DeviceState, Stage
from stream_rlhf.telemetry.stage_counts import StageCounts
from stream_rlhf.weights.device_turns import DeviceTurns
from stream_rlhf.weights.offload_config import OffloadPolicy

SWITCH = OffloadPolicy(["params"], "switch")


def tiny_model(seed: int = 0) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32))


class ModelStage(Stage):
    """A stage holding one real train engine; `steps` records the batches it stepped on."""

    def __init__(self, device: str = "cpu", trains: bool = False, computes: bool = True):
        self.engine = TorchTrainEngine(tiny_model(), RankGroup.single(device),
                                       OptimizerConfig(lr=1e-3) if trains else None)
        self.computes = computes
        self.steps: list[int] = []

    def device_state(self) -> list[DeviceState]:
        return [self.engine]

    def uses_device(self, batch: Batch | None) -> bool:
        return self.computes


def batch(minibatch: int, iteration: int = 0) -> Batch:
    return Batch(Handle(f"h{iteration}.{minibatch}", "rollout", iteration, minibatch, policy_version=0,
                        num_samples=1), {})


def hosted(turns: DeviceTurns, stages: dict[str, tuple[Stage, OffloadPolicy | None]]) -> dict[str, dict[str, float]]:
    """Add and set up each stage; returns the live counts of each."""
    counters = {}
    for name, (stage, policy) in stages.items():
        counts = StageCounts(".", name, name, write=False)
        counters[name] = counts.values
        turns.add(name, stage, policy, counts)
        with turns.setup(name):
            pass
    return counters


def moves(counters: dict[str, float]) -> tuple[int, int]:
    return int(counters["offloads"]), int(counters["onloads"])


def test_a_device_group_member_leaves_only_when_another_takes_the_device():
    turns = DeviceTurns()
    counters = hosted(turns, {"ref_forward": (ModelStage(), SWITCH), "critic_forward": (ModelStage(), SWITCH)})
    assert moves(counters["ref_forward"]) == moves(counters["critic_forward"]) == (1, 0)  # off after setup
    for _ in range(3):  # one stage's steps in a row move nothing after the first
        with turns.step("ref_forward", batch(0)):
            pass
    assert moves(counters["ref_forward"]) == (1, 1)
    with turns.step("critic_forward", batch(0)):
        pass
    assert moves(counters["ref_forward"]) == (2, 1) and moves(counters["critic_forward"]) == (1, 1)
    with turns.step("ref_forward", batch(1)):
        pass
    assert moves(counters["ref_forward"]) == (2, 2) and moves(counters["critic_forward"]) == (2, 1)


def test_step_and_iteration_policies_offload_after_their_step():
    turns = DeviceTurns(last_minibatch=2)
    counters = hosted(turns, {"ref_forward": (ModelStage(), OffloadPolicy(["params"], "iteration")),
                              "critic_forward": (ModelStage(), OffloadPolicy(["params"], "step"))})
    for minibatch in range(3):
        with turns.step("ref_forward", batch(minibatch)):
            pass
        with turns.step("critic_forward", batch(minibatch)):
            pass
    assert moves(counters["ref_forward"]) == (2, 1)  # after setup, after mini-batch 2; back once
    assert moves(counters["critic_forward"]) == (4, 3)  # after setup and after every step


def test_a_step_that_does_not_use_the_model_moves_nothing():
    turns = DeviceTurns()
    buffering = ModelStage(trains=True, computes=False)
    counters = hosted(turns, {"actor_train": (buffering, OffloadPolicy(["params", "grads", "optimizer"], "step"))})
    with turns.step("actor_train", batch(0)):
        pass
    assert moves(counters["actor_train"]) == (1, 0)


def test_one_stage_computes_at_a_time():
    turns = DeviceTurns()
    hosted(turns, {"a": (ModelStage(), SWITCH), "b": (ModelStage(), SWITCH)})
    inside, overlaps = [0], [0]

    def steps(name: str) -> None:
        for minibatch in range(20):
            with turns.step(name, batch(minibatch)):
                inside[0] += 1
                overlaps[0] += inside[0] > 1
                time.sleep(0.001)
                inside[0] -= 1

    threads = [threading.Thread(target=steps, args=(name,)) for name in ("a", "b")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert overlaps[0] == 0


PREFETCH = OffloadPolicy(["params"], "switch", prefetch=True)


def b_waits_during_a_step(turns: DeviceTurns, a_work: Callable[[], object],
                          b_work: Callable[[], object] = lambda: None) -> None:
    """`a` runs `a_work` in its step; `b`'s step (running `b_work`) is due once `a` holds the device."""
    a_inside = threading.Event()

    def b_steps() -> None:
        a_inside.wait()
        with turns.step("b", batch(0)):
            b_work()

    thread = threading.Thread(target=b_steps)
    thread.start()
    with turns.step("a", batch(0)):
        a_inside.set()
        time.sleep(0.05)  # b's step is called while a still holds the device
        a_work()
    thread.join()


def test_a_prefetching_member_is_brought_back_while_another_steps():
    """b's step is due while a holds the device: b's onload runs then (counted once, as a prefetch,
    its time hidden), and a member without `prefetch` waits for the device to onload."""
    turns = DeviceTurns()
    counters = hosted(turns, {"a": (ModelStage(), SWITCH), "b": (ModelStage(), PREFETCH)})
    b_waits_during_a_step(turns, lambda: time.sleep(0.2))
    assert counters["b"]["prefetches"] == 1 and moves(counters["b"]) == (1, 1)  # no second onload in its turn
    assert 0 <= counters["b"]["onload_hidden_s"] <= counters["b"]["onload_s"] + 1e-9
    assert moves(counters["a"]) == (2, 1)  # a left when b took the device
    plain = DeviceTurns()
    counters = hosted(plain, {"a": (ModelStage(), SWITCH), "b": (ModelStage(), SWITCH)})
    b_waits_during_a_step(plain, lambda: None)
    assert counters["b"]["prefetches"] == 0 and moves(counters["b"]) == (1, 1)


def test_a_third_member_taking_the_device_waits_for_the_prefetch_it_undoes():
    turns = DeviceTurns()
    counters = hosted(turns, {"a": (ModelStage(), SWITCH), "b": (ModelStage(), PREFETCH), "c": (ModelStage(), SWITCH)})
    turns._start_prefetch("b")  # as b's step does while a holds the device
    with turns.step("c", batch(0)):  # c's turn moves b's state off again, after the prefetch brought it
        pass
    assert counters["b"]["prefetches"] == 1 and moves(counters["b"]) == (2, 1)
    with turns.step("b", batch(0)):  # back in its own turn, without a prefetch to wait for
        pass
    assert moves(counters["b"]) == (2, 2) and counters["b"]["onload_hidden_s"] == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run by scripts/gpu_checks.sh tests)")
def test_on_cuda_a_prefetch_overlaps_the_other_members_step_and_results_are_exact():
    """b's parameters come back on a side stream during a's step (hidden time > 0), and b's
    log-probs after the prefetch equal a model never moved."""
    big = 64 * 1024 * 1024  # bytes of a's work tensor
    turns = DeviceTurns()
    a, b = ModelStage("cuda:0"), ModelStage("cuda:0")
    reference = TorchTrainEngine(tiny_model(), RankGroup.single("cuda:0"))
    counters = hosted(turns, {"a": (a, SWITCH), "b": (b, PREFETCH)})
    sequences = [torch.randint(0, 64, (12,)), torch.randint(0, 64, (9,))]
    found = []
    work = torch.randn(big // 4 // 1024, 1024, device="cuda:0")

    def a_computes() -> None:  # a's kernels keep the device busy while b's copies run beside them
        for _ in range(200):
            work.mul_(1.0001)
        torch.cuda.synchronize()

    b_waits_during_a_step(turns, a_computes, lambda: found.append(b.engine.forward_logprobs(sequences, 1.0)))
    assert counters["b"]["prefetches"] == 1 and counters["b"]["onload_hidden_s"] > 0
    for x, z in zip(found[0], reference.forward_logprobs(sequences, 1.0), strict=True):
        assert torch.equal(x, z)

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run by scripts/gpu_checks.sh tests)")
def test_on_cuda_a_group_holds_one_model_at_a_time_and_results_are_exact():
    """Two models in one group: after each switch the device holds one of them (memory falls by the
    other's bytes), the bytes counted are the parameters', and the log-probs equal a model never moved."""
    turns = DeviceTurns()
    a, b = ModelStage("cuda:0"), ModelStage("cuda:0")
    reference = TorchTrainEngine(tiny_model(), RankGroup.single("cuda:0"))
    counters = hosted(turns, {"a": (a, SWITCH), "b": (b, SWITCH)})
    param_bytes = sum(p.numel() * p.element_size() for p in a.engine.model.parameters())
    sequences = [torch.randint(0, 64, (12,)), torch.randint(0, 64, (9,))]
    with turns.step("a", batch(0)):  # the first forward also allocates what stays (cuBLAS workspaces)
        logp = a.engine.forward_logprobs(sequences, 1.0)
    with turns.step("b", batch(0)):
        held_b = torch.cuda.memory_allocated()
        assert all(p.device.type == "cpu" and p.is_pinned() for p in a.engine.model.parameters())
        b.engine.forward_logprobs(sequences, 1.0)
    with turns.step("a", batch(1)):
        held_a = torch.cuda.memory_allocated()
        again = a.engine.forward_logprobs(sequences, 1.0)
    assert counters["a"]["offload_bytes"] == counters["a"]["onload_bytes"] == 2 * param_bytes
    assert abs(held_a - held_b) < param_bytes // 2  # one model's worth each time, not two
    expected = reference.forward_logprobs(sequences, 1.0)
    for x, y, z in zip(logp, again, expected, strict=True):
        assert torch.equal(x, y) and torch.equal(x, z)
