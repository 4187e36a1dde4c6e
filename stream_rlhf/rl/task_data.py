"""Where an RL job's prompts come from: the synthetic task's, or a dataset (`data.train`: JSONL,
Parquet or a `datasets` folder; `data/prompts_jsonl.py`).

    cfg = resolve_data(cfg)                      # shapes: writes (once) and points data.* at its files;
                                                 # then check_prompts(cfg)
    dataset = open_prompts(cfg, model_config, tokenizer, "train") # a PromptDataset, or None

The `shapes` and `shapes_dialogue` tasks are written as JSONL + PNG files under
`task.data_dir/<task>-<hash>/` the first time and read from there like any user dataset, so the
same loader (and its bad-input handling) serves both. `arithmetic` and `tool_sums` prompts are made
in memory (`data/text_tasks.py`) and need no dataset.

`check_prompts` runs in the driver before the warm start, with the model's tokenizer (the tiny
model's is built, a `model.path` one is read): every line of the prompt files parses and names
image files that exist and decode (each distinct file once, cached in `task.data_dir`:
`data/image_check.py`) at a supported size (a DataError naming file:line, or with
`data.on_bad_sample: skip` counted as in training), the longest prompt plus
`rollout.max_new_tokens` fits the model's positions (a ConfigError naming both keys), and a
process reward's step separator is one token of the tokenizer (a PRM's vocabulary the policy's).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from transformers import AutoConfig, PretrainedConfig, PreTrainedTokenizerBase

from stream_rlhf.cache_folder import build_once
from stream_rlhf.config import ConfigError
from stream_rlhf.data import shapes, shapes_dialogue
from stream_rlhf.data.chat_template import resolve_chat_template
from stream_rlhf.data.images import ImageSpec
from stream_rlhf.data.prompts_jsonl import PromptDataset
from stream_rlhf.data.task_config import DataConfig
from stream_rlhf.data.text_tasks import TEXT_TASKS, problems
from stream_rlhf.envs.observation_cut import ObservationCut
from stream_rlhf.models.tokenizer import VISION_TOKENS, build_tokenizer
from stream_rlhf.rl.config import RLJobConfig

IMAGE_TASKS = {"shapes": shapes.problems, "shapes_dialogue": shapes_dialogue.problems}
"""The synthetic tasks written as files, and what makes each one's problems."""


def resolve_data(cfg: RLJobConfig) -> RLJobConfig:
    """`cfg` with `data.train` / `data.eval` set to the synthetic task's files when it has some,
    checked by `check_prompts`."""
    if cfg.data.train is None and cfg.task.name in IMAGE_TASKS:
        cfg = replace(cfg, data=_shapes_files(cfg))
    check_prompts(cfg)
    return cfg


def data_files(cfg: RLJobConfig) -> tuple[RLJobConfig, dict[str, str] | None]:
    """(`cfg` with `data.*` pointing at the synthetic task's files once they are written, the
    files still to write): what `resolve_data` returns, with nothing written or checked
    (`stream-rlhf plan` and `stage`). Files not written yet leave `data.*` unset (a DataConfig
    names existing files only)."""
    if cfg.data.train is not None or cfg.task.name not in IMAGE_TASKS:
        return cfg, None
    folder = _shapes_folder(cfg)
    if not (folder / "eval.jsonl").is_file():
        return cfg, {"train": str(folder / "train.jsonl"), "eval": str(folder / "eval.jsonl")}
    return replace(cfg, data=_in_folder(cfg, folder)), None


def _shapes_files(cfg: RLJobConfig) -> DataConfig:
    task = cfg.task
    make = IMAGE_TASKS[task.name]

    def write(partial: Path) -> None:
        shapes.write_split(partial, "train", task.train_prompts, task.seed, make)
        shapes.write_split(partial, "eval", task.eval_prompts, task.seed, make)

    return _in_folder(cfg, build_once(_shapes_folder(cfg), "eval.jsonl", write))


def _shapes_folder(cfg: RLJobConfig) -> Path:
    task = cfg.task
    settings = {"task": task.name, "train": task.train_prompts, "eval": task.eval_prompts, "seed": task.seed}
    key = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:12]
    return Path(task.data_dir) / f"{task.name}-{key}"


def _in_folder(cfg: RLJobConfig, folder: Path) -> DataConfig:
    return replace(cfg.data, train=str(folder / "train.jsonl"), eval=str(folder / "eval.jsonl"))


def open_prompts(cfg: RLJobConfig, model_config: PretrainedConfig, tokenizer: PreTrainedTokenizerBase, split: str,
                 seed: int = 0) -> PromptDataset | None:
    """The prompt dataset of `split` ("train" or "eval") for the model of `model_config`; None when
    the job's prompts are the in-memory arithmetic task."""
    vision = getattr(model_config, "vision_config", None)
    ids = ((model_config.vision_start_token_id, model_config.image_token_id, model_config.vision_end_token_id)
           if vision else None)
    return _prompt_file(cfg, split, tokenizer, vision, ids, seed)


@dataclass(frozen=True)
class _ModelView:
    """What the prompt checks need of the model, before any checkpoint exists."""

    tokenizer: PreTrainedTokenizerBase
    positions: int
    positions_key: str
    """The config key that sets `positions`, for messages."""
    vision: Any
    """As `_prompt_file` takes it."""
    vision_token_ids: tuple[int, int, int] | None


def _prompt_file(cfg: RLJobConfig, split: str, tokenizer: PreTrainedTokenizerBase, vision: Any,
                 vision_token_ids: tuple[int, int, int] | None, seed: int) -> PromptDataset | None:
    """`vision`: a vision config with patch_size, temporal_patch_size, spatial_merge_size (a
    transformers one or `TinyVisionConfig`); None for a text-only model."""
    path, data = cfg.data.train if split == "train" else cfg.data.eval, cfg.data
    if path is None:
        return None
    try:  # the model folder's preprocessor_config.json (a tiny model has none)
        spec = ImageSpec.from_model_folder(cfg.model.path, vision, data.min_pixels, data.max_pixels) if vision else None
    except ValueError as error:
        raise ConfigError(f"model.path={cfg.model.path!r}: {error}") from None
    template = resolve_chat_template(data.chat_template, tokenizer)
    tools = cfg.env.tool_schemas() if cfg.env is not None else None
    if tools and template is None:
        raise ConfigError(f"env.tools: the chat template writes them into the prompts, and there is none "
                          f"(data.chat_template={data.chat_template!r})")
    return PromptDataset(path, tokenizer, spec, vision_token_ids, data.on_bad_sample, data.max_images_per_prompt,
                         seed, template, data.fields, data.system_prompt, image_cache=Path(cfg.task.data_dir),
                         tools=tools)


def check_prompts(cfg: RLJobConfig) -> None:
    """Every prompt line parses and names image files that exist and decode (DataError naming file:line, or
    counted under `data.on_bad_sample: skip`), and the longest prompt + `rollout.max_new_tokens`
    fits the model's positions (ConfigError naming both keys and the numbers); the checks that need
    the tokenizer: process rewards' separator, the observation cut's marker."""
    model = _model_view(cfg)
    if cfg.reward.process is not None:
        from stream_rlhf.stages.process_reward import check_process_reward

        check_process_reward(cfg.reward.process, model.tokenizer)
    if cfg.env is not None:  # the cut marker fits the observation limit in the policy's tokens
        ObservationCut(cfg.env, lambda text: model.tokenizer.encode(text, add_special_tokens=False))
    in_memory = cfg.data.train is None and cfg.task.name in TEXT_TASKS
    longest = _longest_text_task(cfg, model.tokenizer) if in_memory else (0, "")
    for split in ("train", "eval"):
        dataset = _prompt_file(cfg, split, model.tokenizer, model.vision, model.vision_token_ids, cfg.seed)
        if dataset is not None:
            longest = max(longest, dataset.longest_prompt(), key=lambda pair: pair[0])
    tokens, source = longest
    needed = tokens + cfg.rollout.max_new_tokens
    if needed > model.positions:
        raise ConfigError(f"rollout.max_new_tokens={cfg.rollout.max_new_tokens} after the longest prompt ({tokens} "
                          f"tokens, {source}) needs {needed} positions, more than {model.positions_key}="
                          f"{model.positions}")


def _model_view(cfg: RLJobConfig) -> _ModelView:
    if cfg.model.path is None:
        tiny = cfg.model.tiny
        tokenizer = build_tokenizer(vision=tiny.vision is not None)
        ids = tuple(tokenizer.convert_tokens_to_ids(list(VISION_TOKENS))) if tiny.vision else None
        return _ModelView(tokenizer, tiny.max_position_embeddings, "model.tiny.max_position_embeddings",
                          tiny.vision, ids)
    from stream_rlhf.data.tokenizer import load_tokenizer

    config = AutoConfig.from_pretrained(cfg.model.path)
    vision = getattr(config, "vision_config", None)
    ids = (config.vision_start_token_id, config.image_token_id, config.vision_end_token_id) if vision else None
    return _ModelView(load_tokenizer(cfg.model.path), config.get_text_config().max_position_embeddings,
                      f"max_position_embeddings (model.path={cfg.model.path!r})", vision, ids)


def _longest_text_task(cfg: RLJobConfig, tokenizer: PreTrainedTokenizerBase) -> tuple[int, str]:
    """(tokens, description) of the longest prompt of the in-memory text task the run uses, with
    its bos (as the prompt source and the evaluation encode them)."""
    count = cfg.iterations * cfg.rollout_batch.minibatches * cfg.rollout_batch.prompts_per_minibatch
    task = cfg.task
    prompts = {p.prompt for p in problems(task, "train", count, task.seed)}
    prompts |= {p.prompt for p in problems(task, "eval", task.eval_prompts, task.seed)}
    encoded = tokenizer(sorted(prompts), add_special_tokens=False)["input_ids"]
    tokens, prompt = max(zip(map(len, encoded), sorted(prompts)))
    return 1 + tokens, f'"{prompt}" of task.max_operand={task.max_operand}'
