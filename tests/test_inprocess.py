"""The in-process bus runs the same stages through the same broker logic, without sockets."""

from __future__ import annotations

from pathlib import Path

import torch

from stream_rlhf.broker.runtime.inprocess import InProcessBus
from stream_rlhf.config import load_config
from stream_rlhf.demo.stages import PromptSource, ToyForward, ToyRollout, ToyTrainer
from stream_rlhf.job import JobConfig
from stream_rlhf.stage import Batch, Output, Stage

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


class Collect(Stage):
    def __init__(self):
        self.batches: list[Batch] = []

    def step(self, batch):
        self.batches.append(batch)
        return []


def test_demo_dataflow_in_process(tmp_path):
    cfg = load_config(JobConfig, CONFIGS / "broker_demo.yaml")
    bus = InProcessBus(cfg.topology, cfg.broker.__class__(queue_capacity=4), cfg.admission())
    bus.add("prompts", PromptSource(iterations=3, minibatches=2, batch_size=2, prompt_len=4))
    bus.add("rollout", ToyRollout(response_len=3), instances=2)
    bus.add("ref_forward", ToyForward("ref_logp", "ref_logp"))
    bus.add("reward_forward", ToyForward("reward", "reward", per_token=False))
    trainer = ToyTrainer(str(tmp_path), iterations=3, minibatches=2, overlap_depth=1)
    bus.add("trainer", trainer)
    stats = bus.run()
    assert len(trainer.seen) == 6 and set(trainer.seen.values()) == {1}
    assert trainer.version == 3 and trainer.max_staleness <= 1
    assert stats["joins_emitted"] == 6 and stats["inflight_handles"] == 0
    assert bus.transport.held() == 0  # every payload released


def test_joined_batch_carries_every_part_field():
    from stream_rlhf.broker.control.topology import TopicConfig, Topology

    topology = Topology({
        "a": TopicConfig(producers=["src"], consumers=["double"]),
        "b": TopicConfig(producers=["double"]),
        "ab": TopicConfig(join=["a", "b"], consumers=["sink"]),
    })

    class Src(Stage):
        def __init__(self):
            self.i = 0

        def step(self, batch):
            if self.i == 3:
                return None
            self.i += 1
            return [Output("a", {"x": torch.tensor([self.i])}, 1, iteration=0, minibatch=self.i)]

    class Double(Stage):
        def step(self, batch):
            return [Output("b", {"x": batch.tensors["x"] * 2}, 1)]

    sink = Collect()
    bus = InProcessBus(topology)
    bus.add("src", Src())
    bus.add("double", Double())
    bus.add("sink", sink)
    stats = bus.run()
    got = sorted((b.minibatch, b.tensors["x"].item(), b.tensors["b.x"].item()) for b in sink.batches)
    assert got == [(1, 1, 2), (2, 2, 4), (3, 3, 6)]  # the colliding field is prefixed by its topic
    assert stats["join_field_collisions"] == 3
