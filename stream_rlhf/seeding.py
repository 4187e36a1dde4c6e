"""Random generators seeded by name: the same mini-batch samples the same way whichever schedule,
instance or process handles it.

    generator = seeded_generator(*rollout_seed(cfg.seed, iteration, minibatch), device=device)
"""

from __future__ import annotations

import random

import torch


def seeded_generator(*parts: int | str, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator on `device` seeded by `parts` (seed, iteration, mini-batch...): the same
    mini-batch samples the same way whichever schedule, instance or process handles it."""
    return torch.Generator(device).manual_seed(random.Random("/".join(map(str, parts))).getrandbits(63))


def rollout_seed(seed: int, iteration: int, minibatch: int) -> tuple[int | str, ...]:
    """The parts that seed a mini-batch's rollout (its generator; a multi-turn episode's turns add
    the episode's index and the turn's)."""
    return (seed, "rollout", iteration, minibatch)
