"""What actor_train and critic_train share: an iteration's experience and its advantages, the
staleness filter, the split into optimizer steps and the averaging of per-step metrics (the steps
themselves are the train engine's, `backends/torch_engine.py`).

Both trainers compute the same token rewards and advantages from the same experiences, with KL
controllers updated the same way, so they agree on returns without talking to each other.
"""

from __future__ import annotations

from functools import partial

import torch

from stream_rlhf.algos.advantages import ADVANTAGE_ESTIMATORS, grpo
from stream_rlhf.algos.config import KLConfig
from stream_rlhf.algos.kl import AdaptiveKLController, FixedKLController
from stream_rlhf.algos.masked import masked_whiten
from stream_rlhf.experience import Experience
from stream_rlhf.stage import Batch
from stream_rlhf.stages.images import ImageInputs
from stream_rlhf.stages.job_context import JobContext
from stream_rlhf.telemetry import trace


def kl_controller(cfg: KLConfig) -> FixedKLController | AdaptiveKLController:
    if cfg.target is None:
        return FixedKLController(cfg.coef)
    return AdaptiveKLController(cfg.coef, cfg.target, cfg.horizon)


def experience_of(batches: list[Batch], images: ImageInputs) -> Experience:
    """An iteration's experience from its fresh mini-batches, each with its images' features (a
    span "experience" in the trace)."""
    with trace.span("experience", "train", samples=sum(b.num_samples for b in batches)):
        return Experience.from_batches(batches, [images.of(b.tensors) for b in batches])


def advantages_of(exp: Experience, job: JobContext, kl_coef: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, R) advantages and returns of a whole iteration (whitened over it when configured)."""
    algo = job.config.algorithm
    rewards = exp.token_rewards(kl_coef, algo.kl)
    estimator = ADVANTAGE_ESTIMATORS[algo.advantage]
    if not algo.group_std:  # grpo alone reads it (rl/config.py IGNORED_ALGORITHM_KEYS refuses it elsewhere)
        estimator = partial(grpo, scale=False)
    advantages, returns = estimator(rewards, exp.mask, exp.values, exp.group_ids, algo.gamma, algo.lam)
    if algo.whiten_advantages:
        advantages = masked_whiten(advantages, exp.mask)
    return advantages, returns


def minibatch_indices(num_samples: int, parts: int, generator: torch.Generator) -> list[torch.Tensor]:
    """The samples of each optimizer step of one epoch: a shuffled split into `parts`."""
    return list(torch.randperm(num_samples, generator=generator).chunk(parts))


def split_by_staleness(batches: list[Batch], version: int, overlap_depth: int) -> tuple[list[Batch], list[Batch]]:
    """(within the bound, older than `overlap_depth` versions) for training at `version`."""
    fresh = [b for b in batches if version - b.policy_version <= overlap_depth]
    return fresh, [b for b in batches if version - b.policy_version > overlap_depth]


class MetricMeans:
    """Means over an iteration's optimizer steps of the metrics each step reports."""

    def __init__(self):
        self.sums: dict[str, float] = {}
        self.steps = 0

    def add(self, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            self.sums[key] = self.sums.get(key, 0.0) + value
        self.steps += 1

    def means(self) -> dict[str, float]:
        return {key: round(value / max(self.steps, 1), 5) for key, value in self.sums.items()}
