"""The seam between the episode loop (`envs/episode_loop.py`) and a rollout engine: the engine
samples policy turns for many episodes at once, each turn starting when its episode is ready.

    sampler = engine.turn_sampler(batch, params, slots, capacity)   # one at a time
    sampler.start(TurnRequest(key=3, context=ids, images=None, max_new_tokens=32))
    for done in sampler.advance():                      # some generation work; the turns that ended
        done.key, done.ids, done.logps, done.finish_reason, done.policy_version
    sampler.release(3)                                  # episode 3 is over: free what it holds
    sampler.close()

A turn's `context` is every token of its episode so far (prompt, policy turns, observations), the
same ids each time plus what was appended: the torch sampler keeps each episode's KV cache in a
slot and feeds only the ids it has not seen (`backends/episode_sampler.py`); vLLM sends the whole
context as one request per turn and its prefix cache finds the rest. Policy tokens come back as
sampled (ids, and the behaviour log-prob of each under the full tempered distribution, as
`torch_rollout.generate` records them); nobody decodes and re-encodes them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

from torch import Tensor

from stream_rlhf.samples import SampleImages


@dataclass(frozen=True)
class TurnRequest:
    """Sample one policy turn of episode `key`."""

    key: int
    """The episode's slot, 0..slots-1: the episode loop gives each episode in flight its own, and
    a slot released is taken by a later episode."""
    context: Tensor
    """(L,) long: the episode's ids so far, prompt first."""
    images: SampleImages | None
    """The episode's encoded images so far, in token order: the prompt's, then those its
    observations showed (`envs/observation_images.py`); None for text."""
    max_new_tokens: int
    """This turn's budget (rollout.max_new_tokens, less when env.max_episode_tokens is near)."""
    episode: tuple[int | str, ...] = ()
    """Who the episode is, whatever its slot and company: (job seed, "rollout", iteration,
    mini-batch, index in it) in a rollout stage; both samplers seed each turn from it and the
    turn's index (`seeding.TurnSeeds`). Empty: the sampler's own mini-batch and the slot."""


@dataclass(frozen=True)
class TurnDone:
    """One sampled policy turn."""

    key: int
    ids: Tensor
    """(r,) long, the stop token included when one was sampled."""
    logps: Tensor
    """(r,) fp32 behaviour log-probs."""
    finish_reason: Literal["stop", "length"]
    policy_version: int
    """The policy version that sampled the turn (the oldest, when `versions` is set)."""
    versions: Tensor | None = None
    """(r,) int: the version that sampled each token, when the policy changed during the turn (a
    torch rollout with several mini-batches in flight loads new weights as the next one joins)."""


class TurnSampler(Protocol):
    def start(self, request: TurnRequest) -> None:
        """Queue a turn; it joins the running batch at the next `advance`."""

    def advance(self) -> list[TurnDone]:
        """Do some generation work (a decode step; for a remote engine, wait briefly for results)
        and return the turns that ended. With no turn in progress, return [] at once."""

    @property
    def busy(self) -> bool:
        """Whether any started turn has not ended yet."""

    def release(self, key: int) -> None:
        """Episode `key` is over: free whatever the sampler holds for it."""

    def close(self) -> None:
        """Release every episode (the end of the mini-batch)."""
