"""Stand-in stages with the shape of the RLHF dataflow, for the broker demo job and the tests.

They move tensors of realistic shapes through the real broker, payload plane and runners, and
the trainer checks that every mini-batch arrives exactly once within the staleness bound, but
they compute nothing useful: the real stages (rollout, forwards, training) replace them in
`configs/*_ppo.yaml` jobs.

    prompts ─► rollout ─┬─► ref_forward ──┐
                        ├─► reward_forward ┤ join: experience ─► trainer ─► weights_ready(v+1)
                        └──────────────────┘
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from stream_rlhf.stage import Batch, Output, Stage, StageContext


class PromptSource(Stage):
    """Emits `iterations * minibatches` prompt mini-batches of token ids (B, prompt_len)."""

    def __init__(self, iterations: int, minibatches: int, batch_size: int, prompt_len: int, vocab: int = 1000):
        self.shape = (batch_size, prompt_len)
        self.vocab = vocab
        self.order = [(i, m) for i in range(iterations) for m in range(minibatches)]

    def step(self, batch: Batch | None) -> list[Output] | None:
        if not self.order:
            return None
        iteration, minibatch = self.order.pop(0)
        generator = torch.Generator().manual_seed(iteration * 1000 + minibatch)
        prompts = torch.randint(0, self.vocab, self.shape, generator=generator)  # (B, P)
        return [Output("prompts", {"prompt_ids": prompts}, self.shape[0], iteration, minibatch, policy_version=0)]


class ToyRollout(Stage):
    """Appends `response_len` random tokens; sleeps `step_ms` to stand in for generation."""

    def __init__(self, response_len: int, vocab: int = 1000, step_ms: float = 0.0):
        self.response_len = response_len
        self.vocab = vocab
        self.step_s = step_ms / 1000
        self.policy_version = 0

    def on_weights(self, version: int) -> None:
        self.policy_version = version

    def step(self, batch: Batch | None) -> list[Output]:
        prompts = batch.tensors["prompt_ids"]  # (B, P)
        time.sleep(self.step_s)
        response = torch.randint(0, self.vocab, (prompts.shape[0], self.response_len))  # (B, R)
        behavior_logp = -torch.rand(prompts.shape[0], self.response_len)  # (B, R)
        return [Output(
            "rollout",
            {"input_ids": torch.cat([prompts, response], dim=1), "behavior_logp": behavior_logp},
            batch.num_samples,
            policy_version=self.policy_version,
        )]


class ToyForward(Stage):
    """A per-token (or per-sample) tensor derived from the rollout; `out_field` names it."""

    def __init__(self, topic: str, out_field: str, per_token: bool = True, step_ms: float = 0.0):
        self.topic = topic
        self.out_field = out_field
        self.per_token = per_token
        self.step_s = step_ms / 1000

    def step(self, batch: Batch | None) -> list[Output]:
        ids = batch.tensors["input_ids"]  # (B, T)
        time.sleep(self.step_s)
        value = -(ids.float() % 7) / 7 if self.per_token else (ids.float().mean(dim=1) % 1)
        return [Output(self.topic, {self.out_field: value.to(torch.bfloat16)}, batch.num_samples)]


class ToyTrainer(Stage):
    """Counts experiences; after each iteration's mini-batches announces weights v+1.
    Writes `{run_dir}/summary.json` and asks the job to shut down when all have arrived."""

    def __init__(self, run_dir: str, iterations: int, minibatches: int, overlap_depth: int, step_ms: float = 0.0):
        self.run_dir = Path(run_dir)
        self.iterations = iterations
        self.minibatches = minibatches
        self.overlap_depth = overlap_depth
        self.step_s = step_ms / 1000
        self.seen: dict[tuple[int, int], int] = {}
        self.version = 0
        self.max_staleness = 0
        self.started = time.monotonic()

    def setup(self, ctx: StageContext) -> None:
        super().setup(ctx)
        self.started = time.monotonic()

    def step(self, batch: Batch | None) -> list[Output]:
        key = (batch.iteration, batch.minibatch)
        self.seen[key] = self.seen.get(key, 0) + 1
        staleness = self.version - batch.policy_version
        if staleness > self.overlap_depth:
            raise RuntimeError(f"mini-batch {key} from policy v{batch.policy_version} at v{self.version}: "
                               f"staleness {staleness} > overlap_depth {self.overlap_depth}")
        self.max_staleness = max(self.max_staleness, staleness)
        time.sleep(self.step_s)
        # iterations finish out of order when rollout runs ahead; weights advance in order
        while sum(1 for (i, _) in self.seen if i == self.version) == self.minibatches:
            self.version += 1
            self.ctx.send_control("weights_ready", self.version)
            self.ctx.log.info("iteration %d trained: weights v%d", self.version - 1, self.version)
        if len(self.seen) == self.iterations * self.minibatches:
            self._finish()
        return []

    def _finish(self) -> None:
        expected = self.iterations * self.minibatches
        summary = {
            "experiences": len(self.seen),
            "expected": expected,
            "duplicates": sum(n - 1 for n in self.seen.values()),
            "policy_version": self.version,
            "max_staleness": self.max_staleness,
            "wall_s": round(time.monotonic() - self.started, 3),
        }
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        self.ctx.log.info("all %d experiences trained: %s", expected, summary)
        self.ctx.send_control("shutdown", -1)
