"""Evaluation of an `env` job: each held-out prompt runs as an episode in the job's environment
(`envs/episode_loop.py`, over the torch turn sampler), and its score is its return: the reward
function's / model's score of the whole response (if the job has one) plus the environment's
turn rewards. Observations' images are encoded by the model's own vision tower, as rollout's are.
The episodes play lockstep whatever `env.schedule` says, so that a checkpoint scores the same in
every evaluation: streamed, an episode's next turn joins whichever batch is decoding when its tool
answers, and the sampler's draws for it then depend on the tools' timing.

    returns, tokens = episode_returns(cfg, model, scorer, starts, prompts, images, params, generator, static)
    result = play_episodes(cfg, model, tokenizer, starts, prompts, images, params, generator, static)  # the episodes
    returns = returns_of(result, starts, scorer)
"""

from __future__ import annotations

import dataclasses
import logging

import torch
from torch import Tensor, nn
from transformers import PreTrainedTokenizerBase

from stream_rlhf.backends.episode_sampler import TorchTurnSampler, episode_capacity
from stream_rlhf.backends.static_decode import StaticDecoder
from stream_rlhf.backends.torch_rollout import SamplingParams
from stream_rlhf.backends.turn_stop import TurnStop
from stream_rlhf.data.images import ImageSpec
from stream_rlhf.envs.environment import EpisodeStart
from stream_rlhf.envs.episode_handle import episode_tensors
from stream_rlhf.envs.episode_loop import EpisodeResult
from stream_rlhf.envs.episode_runtime import EpisodeRuntime
from stream_rlhf.envs.observation_images import ObservationImages
from stream_rlhf.models.vision_language import encode_images, is_vision_language_model
from stream_rlhf.rl.config import RLJobConfig
from stream_rlhf.samples import Rollout, SampleImages, unragged
from stream_rlhf.stages.reward_forward import Scorer

log = logging.getLogger("stream_rlhf")


@torch.inference_mode()
def episode_returns(cfg: RLJobConfig, model: nn.Module, scorer: Scorer, starts: list[EpisodeStart],
                    prompts: list[Tensor], images: list[SampleImages] | None, params: SamplingParams,
                    seed_parts: tuple[int | str, ...], static: StaticDecoder | None) -> tuple[Tensor, int]:
    """(N,) each episode's return, and the policy tokens sampled."""
    result = play_episodes(cfg, model, scorer.tokenizer, starts, prompts, images, params, seed_parts, static)
    return returns_of(result, starts, scorer), sum(episode.num_policy_tokens for episode in result.episodes)


@torch.inference_mode()
def play_episodes(cfg: RLJobConfig, model: nn.Module, tokenizer: PreTrainedTokenizerBase, starts: list[EpisodeStart],
                  prompts: list[Tensor], images: list[SampleImages] | None, params: SamplingParams,
                  seed_parts: tuple[int | str, ...], static: StaticDecoder | None) -> EpisodeResult:
    """One episode per prompt in the job's environment, to their ends (version 0's tokens), lockstep
    (module docstring); episode i's turns are seeded by (*seed_parts, i) (`seeding.TurnSeeds`)."""
    if cfg.env is None:
        raise ValueError("play_episodes: the job has no env section")
    env = dataclasses.replace(cfg.env, schedule="lockstep")
    runtime = EpisodeRuntime(env, env.threads(len(prompts)), tokenizer, cfg.data.chat_template, params.max_new_tokens)
    capacity = episode_capacity(prompts, params.max_new_tokens, env.max_episode_tokens)
    stop_text = TurnStop(params.stop_strings, runtime.decode) if params.stop_strings else None
    sampler = TorchTurnSampler(model, len(prompts), capacity, params, seed_parts, 0, static, stop_text=stop_text)
    try:
        return runtime.loop.run(starts, prompts, images, sampler, runtime.stepper, _observe(cfg, model, tokenizer))
    finally:
        sampler.close()
        for failure in runtime.close():
            log.warning("evaluation: an environment's close failed: %s", failure)


def returns_of(result: EpisodeResult, starts: list[EpisodeStart], scorer: Scorer) -> Tensor:
    """(N,) each episode's return: the scorer's score of its whole response plus its turn rewards."""
    tensors = episode_tensors(result.episodes)
    rollout = Rollout(unragged(tensors, "sequences"), tensors["prompt_lens"], unragged(tensors, "behavior_logp"),
                      torch.zeros(len(starts), dtype=torch.long))
    scores = scorer.score(rollout, [start.reference for start in starts], [dict(start.fields) for start in starts])
    return scores + torch.stack([rewards.sum() for rewards in unragged(tensors, "env_rewards")])


def _observe(cfg: RLJobConfig, model: nn.Module, tokenizer: PreTrainedTokenizerBase) -> ObservationImages | None:
    """Observations' images through `model`'s vision tower (None for a text model)."""
    if not is_vision_language_model(model):
        return None
    config = model.config
    spec = ImageSpec.from_model_folder(cfg.model.path, config.vision_config, cfg.data.min_pixels, cfg.data.max_pixels)
    ids = (config.vision_start_token_id, config.image_token_id, config.vision_end_token_id)
    return ObservationImages(tokenizer, spec, ids, lambda pixel_values, grid: encode_images(model, pixel_values, grid))
