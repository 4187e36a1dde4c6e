"""A tiny RL job for the tests: a 1-layer model, a 40-step warm start, 2 iterations of 2 mini-batches.

    data = tiny_job(tmp_path, name="t", schedule="sync", overlap_depth=0)
    data = tiny_job(tmp_path, name="mm", **VISION)     # the vision-language variant
    cfg = build(RLJobConfig, data)
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import yaml

CACHE = Path(__file__).resolve().parent.parent / "runs" / ".cache"
"""The warm start is cached across tests (and runs) like a user's."""

TINY: dict[str, Any] = {
    "iterations": 2,
    "rollout_batch": {"prompts_per_minibatch": 8, "minibatches": 2, "samples_per_prompt": 1},
    "rollout": {"max_new_tokens": 4},
    "algorithm": {"ppo_epochs": 1, "train_minibatches": 2},
    "model": {
        "tiny": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 2,
                 "num_key_value_heads": 1, "head_dim": 32, "max_position_embeddings": 32},
        "warm_start": {"steps": 40, "batch_size": 32, "lr": 3.0e-3, "cache_dir": str(CACHE)},
    },
    "task": {"eval_prompts": 32},
    "placement": {"mode": "colocated", "rollout_cores": [0], "train_cores": [min(1, os.cpu_count() - 1)]},
}


VISION: dict[str, Any] = {
    "model.tiny.vision": {"depth": 1, "embed_dim": 32, "num_heads": 1, "mlp_ratio": 2, "patch_size": 8,
                          "temporal_patch_size": 2, "spatial_merge_size": 2},
    "model.tiny.max_position_embeddings": 48,
    "task": {"name": "shapes", "train_prompts": 128, "eval_prompts": 32, "data_dir": str(CACHE)},
    "data.min_pixels": 1024,
    "data.max_pixels": 1024,
    "reward.function": "stream_rlhf.data.shapes:reward",
}
"""Overrides that make the tiny job a vision-language one: a 1-block vision tower, the shapes task."""


def tiny_job(run_root: Path, name: str, **overrides: Any) -> dict[str, Any]:
    data = copy.deepcopy(TINY)
    data.update(name=name, runs_dir=str(run_root))
    for key, value in overrides.items():
        node = data
        *parents, last = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    return data


def write_job(path: Path, data: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(data))
    return path
