"""Evaluation of an `env` job: each held-out prompt runs as an episode in the job's environment,
through the same episode loop as rollout, and scores the sum of its turn rewards (plus the
configured reward of the whole episode, when the job has one, as training scores it).

    scores, tokens = episode_scores(cfg, model, tokenizer, chunk, images, params, static, seed_parts, score)

`EvalTurns` is the `TurnSampler` evaluation uses (`envs/turns.py`): each `advance` samples every
turn started since the last one as one batch through `static_sampler.sample` (the evaluation's
decode, eager or static as `rollout.decode` says), and keeps nothing between turns: each turn
prefills its whole context. Evaluation is small and runs between training, so the simple form is
enough; rollout's samplers keep each episode's cache instead. The episodes run lock-step
(`env.schedule: lockstep`, whatever the job's): each round's turns are one batch whatever the
environment's timing, so the same seed samples the same episodes and the score is reproducible.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch
from torch import Tensor, nn
from transformers import PreTrainedTokenizerBase

from stream_rlhf.backends.static_decode import StaticDecoder
from stream_rlhf.backends.static_sampler import sample
from stream_rlhf.backends.torch_rollout import SamplingParams
from stream_rlhf.envs.environment import EpisodeStart
from stream_rlhf.envs.episode_loop import EpisodeLoop
from stream_rlhf.envs.stepper import EnvStepper
from stream_rlhf.envs.turns import TurnDone, TurnRequest
from stream_rlhf.rl.config import RLJobConfig
from stream_rlhf.samples import Rollout, SampleImages
from stream_rlhf.seeding import seeded_generator


class EvalTurns:
    """A TurnSampler that samples the turns started since its last `advance` together (see the
    module docstring); `generator(call)` gives the seeded generator of its call-th batch."""

    def __init__(self, model: nn.Module, params: SamplingParams, static: StaticDecoder | None,
                 generator: Callable[[int], torch.Generator]):
        self.model, self.params, self.static, self.generator = model, params, static, generator
        self.pending: list[TurnRequest] = []
        self.calls = 0

    def start(self, request: TurnRequest) -> None:
        self.pending.append(request)

    def advance(self) -> list[TurnDone]:
        done = []
        for budget in sorted({request.max_new_tokens for request in self.pending}):
            group = [request for request in self.pending if request.max_new_tokens == budget]
            images = [request.images for request in group] if group[0].images is not None else None
            generation = sample(self.model, [request.context for request in group],
                                replace(self.params, max_new_tokens=budget), self.generator(self.calls), images,
                                self.static)
            self.calls += 1
            done += [TurnDone(request.key, ids, logps, finish, policy_version=0) for request, ids, logps, finish
                     in zip(group, generation.response_ids, generation.response_logp, generation.finish_reasons,
                            strict=True)]
        self.pending = []
        return done

    @property
    def busy(self) -> bool:
        return bool(self.pending)

    def release(self, key: int) -> None:
        """Nothing is kept per episode."""

    def close(self) -> None:
        self.pending = []


def episode_scores(cfg: RLJobConfig, model: nn.Module, tokenizer: PreTrainedTokenizerBase,
                   chunk: list[tuple[Tensor, str, list, dict, tuple[str, ...]]], images: list[SampleImages] | None,
                   params: SamplingParams, static: StaticDecoder | None, seed_parts: tuple,
                   score: Callable[[Rollout, list[str], list[dict]], Tensor]) -> tuple[Tensor, int]:
    """((N,) each episode's summed turn rewards plus `score` of its whole sequence, the policy
    tokens sampled) for `chunk`'s (prompt ids, reference, images, reward kwargs, image paths)
    items, each an episode in `cfg.env`. `score` is the job's configured reward (zeros when it has none)."""
    if cfg.env is None:
        raise ValueError("episode_scores: the job has no env section")
    env = replace(cfg.env, schedule="lockstep")  # every round one batch: the same seed, the same episodes

    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=True)

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    prompts = [prompt for prompt, *_ in chunk]
    starts = [EpisodeStart(decode(prompt.tolist()), reference, paths, kwargs)
              for prompt, reference, _, kwargs, paths in chunk]
    sampler = EvalTurns(model, params, static, lambda call: seeded_generator(*seed_parts, call))
    stepper = EnvStepper(env.step_timeout_s, env.workers)
    try:
        result = EpisodeLoop(env, decode, encode, params.max_new_tokens).run(starts, prompts, images, sampler,
                                                                              stepper)
    finally:
        stepper.close()
    episodes = result.episodes
    rollout = Rollout([torch.tensor(e.prompt_ids + e.token_ids) for e in episodes],
                      torch.tensor([len(e.prompt_ids) for e in episodes]),
                      [torch.tensor(e.behavior_logp) for e in episodes], torch.zeros(len(episodes)))
    turn_rewards = torch.tensor([sum(e.turn_rewards) for e in episodes])
    scores = turn_rewards + score(rollout, [item[1] for item in chunk], [item[3] for item in chunk])
    return scores, sum(e.num_policy_tokens for e in episodes)
