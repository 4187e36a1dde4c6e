"""Where an RL job's prompts come from: the synthetic task's, or a JSONL dataset (`data.train`).

    cfg = resolve_data(cfg)                      # shapes: writes (once) and points data.* at its files
    dataset = open_prompts(cfg, model_config, tokenizer, "train") # a PromptDataset, or None

The `shapes` task is written as JSONL + PNG files under `task.data_dir/shapes-<hash>/` the first
time and read from there like any user dataset, so the same loader (and its bad-input handling)
serves both. `arithmetic` prompts are made in memory and need no dataset.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace
from pathlib import Path

from transformers import PretrainedConfig, PreTrainedTokenizerBase

from stream_rlhf.cache_folder import build_once
from stream_rlhf.data import shapes
from stream_rlhf.data.images import ImageSpec
from stream_rlhf.data.prompts_jsonl import PromptDataset
from stream_rlhf.rl.config import RLJobConfig


def resolve_data(cfg: RLJobConfig) -> RLJobConfig:
    """`cfg` with `data.train` / `data.eval` set to the synthetic task's files when it has some."""
    if cfg.data.train is not None or cfg.task.name != "shapes":
        return cfg
    task = cfg.task
    settings = {"task": "shapes", "train": task.train_prompts, "eval": task.eval_prompts, "seed": task.seed}
    key = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:12]

    def write(partial: Path) -> None:
        shapes.write_split(partial, "train", task.train_prompts, task.seed)
        shapes.write_split(partial, "eval", task.eval_prompts, task.seed)

    folder = build_once(Path(task.data_dir) / f"shapes-{key}", "eval.jsonl", write)
    data = replace(cfg.data, train=str(folder / "train.jsonl"), eval=str(folder / "eval.jsonl"))
    return replace(cfg, data=data)


def open_prompts(cfg: RLJobConfig, model_config: PretrainedConfig, tokenizer: PreTrainedTokenizerBase, split: str,
                 seed: int = 0) -> PromptDataset | None:
    """The JSONL prompts of `split` ("train" or "eval") for the model of `model_config`; None when
    the job's prompts are the in-memory arithmetic task."""
    path = cfg.data.train if split == "train" else cfg.data.eval
    if path is None:
        return None
    vision = getattr(model_config, "vision_config", None)
    spec = ImageSpec.from_vision_config(vision, cfg.data.min_pixels, cfg.data.max_pixels) if vision else None
    ids = ((model_config.vision_start_token_id, model_config.image_token_id, model_config.vision_end_token_id)
           if vision else None)
    return PromptDataset(path, tokenizer, spec, ids, cfg.data.on_bad_sample, cfg.data.max_images_per_prompt, seed)
