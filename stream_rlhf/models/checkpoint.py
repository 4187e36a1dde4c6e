"""Loading the models of an RL job from a Hugging Face checkpoint folder, and building the tiny one.

    policy = load_policy(path)          # AutoModelForCausalLM: actor, reference, rollout
    save_checkpoint(policy, tokenizer, folder)   # a folder transformers and vLLM both load
    critic = load_critic(path)          # the policy's backbone with a per-token value head
                                        # (a VLM's: its language model, see vision_language.py)
    critic = load_critic_from_reward_model(reward_path, policy_path)   # critic.init: reward_model
    scorer = load_reward_model(path)    # a sequence-classification model with one label

Real checkpoints and the embedded tiny model go through the same calls; the tiny one is built
by `build_tiny` and saved into a folder first (see `warm_start.py`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    Qwen2VLImageProcessorPil,
)
from transformers.utils import logging as hf_logging

from stream_rlhf.models.model_config import TinyModelConfig
from stream_rlhf.models.tiny_architectures import tiny_model
from stream_rlhf.models.vision_language import VisionLanguageCritic, load_vision_language_critic

if TYPE_CHECKING:  # the job's config, read by load_job_critic only
    from stream_rlhf.rl.config import RLJobConfig


def build_tiny(cfg: TinyModelConfig, tokenizer: PreTrainedTokenizerBase, seed: int) -> PreTrainedModel:
    """A random-initialised model of `cfg.architecture` sized by `cfg` (`tiny_architectures.py`);
    with `cfg.vision` a vision-language one (the tokenizer must then hold `VISION_TOKENS`)."""
    torch.manual_seed(seed)
    return tiny_model(cfg, tokenizer)


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks of a Hugging Face model (the units FSDP2 shards one by one, and the
    layers LoRA adapts: `lora.py`)."""
    return [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]


def is_vision_language(path: str | Path) -> bool:
    """True for a checkpoint with a vision tower (Qwen2-VL, Qwen2.5-VL, Qwen3-VL)."""
    return hasattr(AutoConfig.from_pretrained(str(path)), "vision_config")


def save_checkpoint(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, folder: str | Path,
                    state_dict: dict[str, torch.Tensor] | None = None) -> None:
    """Save a policy (with `state_dict` in place of its own: a sharded model's gathered weights)
    as a folder that both transformers and vLLM load. A vision-language one also gets what vLLM's
    Qwen2-VL processor reads: `preprocessor_config.json`, and a tokenizer that names a video token
    (ours has no `<|video_pad|>`: the token `video_token_id` stands for)."""
    folder = Path(folder)
    model.save_pretrained(folder, state_dict=state_dict)
    tokenizer.save_pretrained(folder)
    vision = getattr(model.config, "vision_config", None)
    if vision is None:
        return
    Qwen2VLImageProcessorPil(patch_size=vision.patch_size, temporal_patch_size=vision.temporal_patch_size,
                             merge_size=vision.spatial_merge_size).save_pretrained(folder)
    tokenizer_config = folder / "tokenizer_config.json"
    settings = json.loads(tokenizer_config.read_text())
    settings["video_token"] = tokenizer.convert_ids_to_tokens(model.config.video_token_id)
    tokenizer_config.write_text(json.dumps(settings, indent=2))


def max_positions(path: str | Path) -> int:
    """The longest sequence (prompt + response) the checkpoint's language model takes."""
    return AutoConfig.from_pretrained(str(path)).get_text_config().max_position_embeddings


def load_policy(path: str | Path) -> PreTrainedModel:
    """The causal LM of a text checkpoint, or the whole vision-language model of a VLM checkpoint."""
    if is_vision_language(path):
        return AutoModelForImageTextToText.from_pretrained(str(path), dtype=torch.float32)
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)


def load_critic(path: str | Path) -> PreTrainedModel | VisionLanguageCritic:
    """The policy checkpoint's backbone with a freshly zero-initialised scalar head per token; for a
    VLM checkpoint its language model (no vision tower), fed precomputed image features. No dropout
    before the head (transformers' token classifiers default to 0.1): value targets are regressed
    exactly, and training gives the same result whichever ranks share it."""
    if is_vision_language(path):
        return load_vision_language_critic(path)
    hf_logging.set_verbosity_error()  # the new head is reported as "missing" from the checkpoint
    critic = AutoModelForTokenClassification.from_pretrained(str(path), num_labels=1, dtype=torch.float32)
    for module in critic.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    head = critic.score
    torch.nn.init.zeros_(head.weight)
    if head.bias is not None:
        torch.nn.init.zeros_(head.bias)
    return critic


ARCHITECTURE_KEYS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim")
"""What a critic started from the reward model must share with the policy (it reads the policy's
token ids, and `critic.init: reward_model` promises the policy's architecture)."""


def architecture_differences(reward_path: str | Path, policy_path: str | Path) -> list[str]:
    """"key: reward value != policy value" for each architecture setting the two differ in."""
    reward, policy = (AutoConfig.from_pretrained(str(p)) for p in (reward_path, policy_path))
    if hasattr(policy, "vision_config"):
        return ["the policy is a vision-language model (its critic is built from the policy)"]
    return [f"{key}: {getattr(reward, key, None)!r} != {getattr(policy, key, None)!r}" for key in ARCHITECTURE_KEYS
            if getattr(reward, key, None) != getattr(policy, key, None)]


def load_critic_from_reward_model(reward_path: str | Path, policy_path: str | Path) -> PreTrainedModel:
    """A critic whose backbone and value head are the reward model's (a sequence-classification
    checkpoint of the policy's architecture): its scalar head, read at every token, becomes the
    value head (a zero bias added). A ValueError naming each difference when the architectures
    differ."""
    if differences := architecture_differences(reward_path, policy_path):
        raise ValueError(f"critic.init=reward_model: reward.model_path={str(reward_path)!r} does not match the policy "
                         f"{str(policy_path)!r} ({'; '.join(differences)})")
    hf_logging.set_verbosity_error()  # the head's bias is reported as "missing" from the checkpoint
    critic, info = AutoModelForTokenClassification.from_pretrained(
        str(reward_path), num_labels=1, dtype=torch.float32, output_loading_info=True)
    if missing := [key for key in info["missing_keys"] if key != "score.bias"]:
        raise ValueError(f"critic.init=reward_model: {reward_path} lacks {missing} (expected the backbone and "
                         "a one-label `score` head of a sequence-classification model)")
    for module in critic.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    if critic.score.bias is not None:
        torch.nn.init.zeros_(critic.score.bias)
    return critic


def load_job_critic(cfg: RLJobConfig, checkpoint: str | Path) -> PreTrainedModel | VisionLanguageCritic:
    """The critic an RL job starts from: `critic.init` says whose weights."""
    if cfg.critic.init == "reward_model":
        return load_critic_from_reward_model(cfg.reward.model_path, checkpoint)
    return load_critic(checkpoint)


def load_reward_model(path: str | Path) -> PreTrainedModel:
    model = AutoModelForSequenceClassification.from_pretrained(str(path), num_labels=1, dtype=torch.float32)
    if model.config.num_labels != 1:
        raise ValueError(f"reward model {path}: {model.config.num_labels} labels, expected 1 (a scalar head)")
    return model.eval()
