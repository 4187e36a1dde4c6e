"""Random generators seeded by name: the same mini-batch samples the same way whichever schedule,
instance or process handles it.

    generator = seeded_generator(*rollout_seed(cfg.seed, iteration, minibatch), device=device)
    seeds = TurnSeeds(rollout_seed(cfg.seed, iteration, minibatch))   # a turn sampler's
    seed = seeds.next(slot, episode)                                  # each policy turn's own
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


class TurnSeeds:
    """The seed of each policy turn a multi-turn sampler starts: turn t of an episode draws from
    seeded_generator(*episode, t), where `episode` is the episode's name (TurnRequest.episode: job
    seed, "rollout", iteration, mini-batch, index) or, for one without, (*seed_parts, slot). So an
    episode samples the same way whatever its slot, company and the order of its turns."""

    def __init__(self, seed_parts: tuple[int | str, ...]):
        self.seed_parts = seed_parts
        self.started: dict[tuple[int | str, ...], int] = {}
        """Episode name -> turns started (the next turn's index)."""
        self.named: dict[int, tuple[int | str, ...]] = {}
        """Slot -> the name its request gave (forgotten at `release`: the slot may take another episode)."""

    def next(self, slot: int, episode: tuple[int | str, ...]) -> int:
        """The seed of the turn starting now in `slot`, for the episode named `episode` (empty: none)."""
        name = episode or (*self.seed_parts, slot)
        if episode:
            self.named[slot] = episode
        turn = self.started.get(name, 0)
        self.started[name] = turn + 1
        return int(torch.randint(0, 2**62, (1,), generator=seeded_generator(*name, turn)))

    def release(self, slot: int) -> None:
        """The episode in `slot` is over; a named one's count is dropped (an unnamed slot's goes on)."""
        if (episode := self.named.pop(slot, None)) is not None:
            del self.started[episode]
