"""Evaluation of a checkpoint on the task's held-out prompts: mean reward of sampled responses
(at the rollout temperature: the quantity RL maximises) and of greedy ones.

    evaluate(cfg, checkpoint)  -> {"reward": 0.42, "greedy_reward": 0.55, "prompts": 256, "skipped": {},
                                   "skipped_examples": [], "response_tokens": 1432, "decode": "eager"}

The prompts are the in-memory text task's eval split or every line of `data.eval` (with
`data.on_bad_sample: skip`, bad lines are counted in "skipped" by reason, the first messages kept
in "skipped_examples"; "response_tokens" counts the tokens sampled, both temperatures). A
vision-language model encodes each eval image once, with its own vision tower. The model runs on
the job's device (`placement.device`: the driver calls this in a child process there,
`device_child.py`; a 358M model took ~45 s per evaluation on the host's cores). Decoding is
eager, static or graphed as `rollout.decode` says (the same tokens in every mode). An `env` job
runs each prompt as an episode in its environment and scores its return
(`evaluate_episodes.py`); "response_tokens" then counts policy tokens.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers import PreTrainedTokenizerBase

from stream_rlhf.backends.decode_attention import use_decode_attention
from stream_rlhf.backends.static_decode import StaticDecoder, static_decoder
from stream_rlhf.backends.static_sampler import sample
from stream_rlhf.backends.torch_rollout import SamplingParams
from stream_rlhf.data.prompts_jsonl import PromptDataset
from stream_rlhf.data.text_tasks import problems
from stream_rlhf.data.tokenizer import load_tokenizer, stop_token_ids
from stream_rlhf.driver.evaluate_episodes import episode_returns
from stream_rlhf.envs.environment import EpisodeStart
from stream_rlhf.models.checkpoint import load_policy
from stream_rlhf.models.vision_language import encode_images, is_vision_language_model
from stream_rlhf.rl.config import RLJobConfig
from stream_rlhf.rl.task_data import open_prompts
from stream_rlhf.samples import Rollout, SampleImages
from stream_rlhf.seeding import seeded_generator
from stream_rlhf.stages.images import samples_of
from stream_rlhf.stages.job_context import JobContext
from stream_rlhf.stages.reward_forward import Scorer


def evaluate(cfg: RLJobConfig, checkpoint: str, batch_size: int = 128) -> dict[str, Any]:
    tokenizer, model, static = eval_policy(cfg, checkpoint)
    items, dataset = eval_items(cfg, model, tokenizer)
    chunks = [items[first:first + batch_size] for first in range(0, len(items), batch_size)]
    chunk_images = [prompt_features(model, chunk) for chunk in chunks]  # encoded once, for both temperatures
    result: dict[str, Any] = {"prompts": len(items), "skipped": dict(dataset.skipped) if dataset else {},
                              "skipped_examples": list(dataset.skipped_examples) if dataset else [],
                              "response_tokens": 0, "decode": "eager" if static is None else static.mode}
    with Scorer(JobContext(cfg, checkpoint, "")) as scorer:  # with reward.workers, its processes end after
        for name, temperature in (("reward", cfg.rollout.temperature), ("greedy_reward", 0.0)):
            params = eval_params(cfg, tokenizer, checkpoint, temperature)
            scores = []
            for index, (chunk, images) in enumerate(zip(chunks, chunk_images)):
                prompts = [prompt for prompt, *_ in chunk]
                seed_parts = (cfg.seed, "eval", index * batch_size)
                if cfg.env is not None:  # multi-turn: each prompt an episode in the job's environment
                    returns, tokens = episode_returns(cfg, model, scorer, [item[4] for item in chunk], prompts, images,
                                                      params, seed_parts, static)
                    result["response_tokens"] += tokens
                    scores.append(returns)
                    continue
                gen = sample(model, prompts, params, seeded_generator(*seed_parts), images, static)
                rollout = Rollout([torch.cat([p, r]) for p, r in zip(prompts, gen.response_ids)],
                                  torch.tensor([len(p) for p in prompts]), gen.response_logp, torch.zeros(len(chunk)))
                result["response_tokens"] += sum(len(response) for response in gen.response_ids)
                scores.append(scorer.score(rollout, [item[1] for item in chunk], [item[3] for item in chunk]))
            result[name] = round(torch.cat(scores).mean().item(), 4)
    return result


def eval_policy(cfg: RLJobConfig, checkpoint: str) -> tuple[PreTrainedTokenizerBase, nn.Module, StaticDecoder | None]:
    """The checkpoint's tokenizer and policy on the job's device, and the decoder `rollout.decode`
    asks for there (None: eager)."""
    tokenizer = load_tokenizer(checkpoint)
    model = load_policy(checkpoint).eval().to(cfg.placement.resolved_device())
    use_decode_attention(model)
    return tokenizer, model, static_decoder(cfg.rollout.decode, next(model.parameters()).device, model)


def eval_params(cfg: RLJobConfig, tokenizer: PreTrainedTokenizerBase, checkpoint: str,
                temperature: float) -> SamplingParams:
    """Rollout's sampling params (its stop tokens, an env's stop strings) at `temperature`."""
    stop_ids = stop_token_ids(tokenizer, cfg.rollout.stop, cfg.data.chat_template, checkpoint)
    return SamplingParams(temperature, cfg.rollout.top_p, cfg.rollout.max_new_tokens, stop_ids,
                          tokenizer.pad_token_id, tuple(cfg.env.stop_strings) if cfg.env else ())


EvalItem = tuple[torch.Tensor, str, list, dict, EpisodeStart]
"""(prompt ids, reference, the prompt's images, the reward function's extra keywords, its episode start)."""


def eval_items(cfg: RLJobConfig, model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase
               ) -> tuple[list[EvalItem], PromptDataset | None]:
    """The held-out prompts: the in-memory task's eval split, or `data.eval`'s lines (and that dataset,
    with its skipped lines' counts)."""
    dataset = open_prompts(cfg, model.config, tokenizer, "eval")
    if dataset is None:
        task = cfg.task
        samples = [(torch.tensor([tokenizer.bos_token_id, *tokenizer.encode(p.prompt, add_special_tokens=False)]),
                    p.answer, [], {}, ()) for p in problems(task, "eval", task.eval_prompts, task.seed)]
    else:
        samples = [(s.prompt_ids, s.answer, s.images, s.reward_kwargs, s.image_paths) for s in dataset.each_sample()]
    # an episode starts from the prompt as rollout gives it: its ids decoded without special tokens
    return [(ids, answer, images, kwargs, EpisodeStart(tokenizer.decode(ids, skip_special_tokens=True), answer, paths,
                                                       kwargs))
            for ids, answer, images, kwargs, paths in samples], dataset


def prompt_features(model: torch.nn.Module, chunk: list) -> list[SampleImages] | None:
    """Each prompt's image features (None for a text model)."""
    if not is_vision_language_model(model):
        return None
    images = [image for _, _, own, *_ in chunk for image in own]
    grid = torch.stack([im.grid_thw for im in images]) if images else torch.zeros((0, 3), dtype=torch.long)
    pixel_values = torch.cat([im.pixel_values for im in images]) if images else torch.zeros(0)
    per_image = encode_images(model, pixel_values, grid)
    counts = [len(own) for _, _, own, *_ in chunk]
    starts = [sum(counts[:i]) for i in range(len(counts))]
    return samples_of(per_image, grid, [torch.arange(start, start + n) for start, n in zip(starts, counts)])
