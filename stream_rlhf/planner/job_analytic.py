"""A job's analytic profile (`analytic.py`) from its config alone: what `stream-rlhf plan CONFIG
--search` uses without `--profile`.

    profile, device = job_analytic_profile(cfg, plan.flow, device=None)   # this machine, timed
    profile, device = job_analytic_profile(cfg, plan.flow, device_figures("h100,count=8"))

The model's shape comes from the tiny model's config keys (`model.tiny`, the vocabulary from the
project's tokenizer) or from `model.path`'s config.json (a vision-language model's text part);
a critic of `critic.init: reward_model` and a reward model (`reward.model_path`) from theirs; a
trainer with LoRA adapters (`actor.lora`, `critic.lora`) trains their parameters only.
Tokens per mini-batch: prompts x samples per prompt x (prompt + response); the prompt's tokens
are the arithmetic task's mean (its bos included) unless given, the response's
`rollout.max_new_tokens` unless given (a response that stops at <eos> is shorter: give its mean;
an env job's episodes plan every turn at that length: `planned_response_tokens`).
The stages' edges are the broker's topics, as the run will route them.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import replace
from pathlib import Path
from typing import Any

from stream_rlhf.config import ConfigError
from stream_rlhf.launch.plan import Dataflow
from stream_rlhf.planner.analytic import ModelShape, Workload, analytic_profile
from stream_rlhf.planner.calibrate import Profile
from stream_rlhf.planner.devices import DeviceFigures
from stream_rlhf.planner.micro_calibration import this_machine
from stream_rlhf.rl.config import RLJobConfig
from stream_rlhf.telemetry.trace_merge import topic_sources

PROMPTS_SAMPLED = 64
"""Arithmetic prompts whose mean length is the prompt's tokens."""


def job_analytic_profile(cfg: RLJobConfig, flow: Dataflow, device: DeviceFigures | None,
                         prompt_tokens: float | None = None, response_tokens: float | None = None,
                         ranks: dict[str, int] | None = None) -> tuple[Profile, DeviceFigures]:
    """The profile of `cfg`'s stages on `device` (None: this machine, timed once and cached in
    `model.warm_start.cache_dir`), and the figures used."""
    shape = model_shape(cfg)
    work = job_workload(cfg, prompt_tokens, response_tokens)
    if device is None:
        threads = len(cfg.placement.mode_cores(rollout_side=False))
        device = this_machine(shape, work, threads, Path(cfg.model.warm_start.cache_dir))
    shapes: dict[str, ModelShape] = {}
    if cfg.reward.model_path is not None:
        shapes["reward_forward"] = shape_of_checkpoint(Path(cfg.reward.model_path))
        if cfg.critic.init == "reward_model":
            shapes["critic_forward"] = shapes["critic_train"] = shapes["reward_forward"]
    for stage, lora in (("actor_train", cfg.actor.lora), ("critic_train", cfg.critic.lora)):
        if lora is not None:  # the trainer's cheaper passes and steps
            shapes[stage] = replace(shapes.get(stage, shape), lora_rank=lora.rank,
                                    lora_targets=tuple(lora.target_modules))
    return analytic_profile(stage_inputs(flow), shape, work, device, ranks, shapes), device


def stage_inputs(flow: Dataflow) -> dict[str, tuple[str, ...]]:
    """Stage -> the stages whose outputs it consumes (through the broker's topics)."""
    sources = topic_sources(flow.topology)
    return {stage: tuple(sorted({producer for topic, config in flow.topology.topics.items()
                                 if stage in config.consumers for producer in sources[topic]}))
            for stage in flow.stages}


def model_shape(cfg: RLJobConfig) -> ModelShape:
    """The policy's shape (module docstring)."""
    if cfg.model.path is not None:
        return shape_of_checkpoint(Path(cfg.model.path))
    from stream_rlhf.models.tokenizer import build_tokenizer

    tiny = cfg.model.tiny
    vocab = len(build_tokenizer(vision=tiny.vision is not None))
    return ModelShape(hidden=tiny.hidden_size, intermediate=tiny.intermediate_size, layers=tiny.num_hidden_layers,
                      heads=tiny.num_attention_heads, kv_heads=tiny.num_key_value_heads, head_dim=tiny.head_dim,
                      vocab=vocab, tied=True)


def shape_of_checkpoint(folder: Path) -> ModelShape:
    """A Hugging Face checkpoint's shape from its config.json (`text_config` where it has one)."""
    config: dict[str, Any] = json.loads((folder / "config.json").read_text())
    text = config.get("text_config") or config
    try:
        heads = text["num_attention_heads"]
        return ModelShape(hidden=text["hidden_size"], intermediate=text["intermediate_size"],
                          layers=text["num_hidden_layers"], heads=heads,
                          kv_heads=text.get("num_key_value_heads", heads),
                          head_dim=text.get("head_dim") or text["hidden_size"] // heads, vocab=text["vocab_size"],
                          tied=bool(config.get("tie_word_embeddings", text.get("tie_word_embeddings", False))))
    except KeyError as exc:
        raise ConfigError(f"{folder}/config.json: no {exc.args[0]} (a decoder-only transformer's config)") from exc


def job_workload(cfg: RLJobConfig, prompt_tokens: float | None = None,
                 response_tokens: float | None = None) -> Workload:
    if prompt_tokens is None:
        prompt_tokens = arithmetic_prompt_tokens(cfg)
    batch = cfg.rollout_batch
    return Workload(rows=batch.samples_per_minibatch, prompt_tokens=prompt_tokens,
                    response_tokens=planned_response_tokens(cfg, prompt_tokens)[0] if response_tokens is None
                    else response_tokens,
                    minibatches=batch.minibatches, ppo_epochs=cfg.algorithm.ppo_epochs,
                    train_minibatches=cfg.algorithm.train_minibatches,
                    reference_in_trainer=cfg.algorithm.kl.reference == "lora_base")


def planned_response_tokens(cfg: RLJobConfig, prompt_tokens: float) -> tuple[float, str]:
    """The response length planned before anything is measured, and where it comes from: an
    answer's `rollout.max_new_tokens`, or an episode's every turn at that length, within
    `env.max_episode_tokens` (observations and tool time are not modelled: `replan` measures)."""
    if cfg.env is None:
        return float(cfg.rollout.max_new_tokens), "rollout.max_new_tokens"
    turns = cfg.env.max_turns * cfg.rollout.max_new_tokens
    room = max(cfg.env.max_episode_tokens - prompt_tokens, float(cfg.rollout.max_new_tokens))
    return float(min(turns, room)), "env.max_turns x rollout.max_new_tokens, within env.max_episode_tokens"


def arithmetic_prompt_tokens(cfg: RLJobConfig) -> float:
    """The mean tokens of the task's first prompts, with the bos the prompt source adds."""
    from stream_rlhf.data.text_tasks import TEXT_TASKS, problems

    if cfg.data.train is not None or cfg.task.name not in TEXT_TASKS:
        raise ConfigError("--prompt-tokens: needed for prompts other than the in-memory text tasks' "
                          f"(task.name={cfg.task.name}, data.train={cfg.data.train})")
    from stream_rlhf.models.tokenizer import build_tokenizer

    prompts = [p.prompt for p in problems(cfg.task, "train", PROMPTS_SAMPLED, cfg.task.seed)]
    encoded = build_tokenizer()(prompts, add_special_tokens=False)["input_ids"]
    return 1 + statistics.fmean(map(len, encoded))
