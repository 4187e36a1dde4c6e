"""Loading the models of an RL job from a Hugging Face checkpoint folder, and building the tiny one.

    policy = load_policy(path)          # AutoModelForCausalLM: actor, reference, rollout
    critic = load_critic(path)          # the policy's backbone with a per-token value head
    scorer = load_reward_model(path)    # a sequence-classification model with one label

Real checkpoints and the embedded tiny model go through the same calls; the tiny one is built
by `build_tiny` and saved into a folder first (see `warm_start.py`).
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    Qwen2Config,
    Qwen2ForCausalLM,
)
from transformers.utils import logging as hf_logging

hf_logging.disable_progress_bar()  # no "Loading weights" bars from every stage process

from stream_rlhf.rl.config import TinyModelConfig


def build_tiny(cfg: TinyModelConfig, tokenizer: PreTrainedTokenizerBase, seed: int) -> PreTrainedModel:
    """A random-initialised Qwen2-architecture causal LM sized by `cfg`."""
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return Qwen2ForCausalLM(config)


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_policy(path: str | Path) -> PreTrainedModel:
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)


def load_critic(path: str | Path) -> PreTrainedModel:
    """The policy checkpoint's backbone with a freshly zero-initialised scalar head per token."""
    hf_logging.set_verbosity_error()  # the new head is reported as "missing" from the checkpoint
    critic = AutoModelForTokenClassification.from_pretrained(str(path), num_labels=1, dtype=torch.float32)
    head = critic.score
    torch.nn.init.zeros_(head.weight)
    if head.bias is not None:
        torch.nn.init.zeros_(head.bias)
    return critic


def load_reward_model(path: str | Path) -> PreTrainedModel:
    model = AutoModelForSequenceClassification.from_pretrained(str(path), num_labels=1, dtype=torch.float32)
    if model.config.num_labels != 1:
        raise ValueError(f"reward model {path}: {model.config.num_labels} labels, expected 1 (a scalar head)")
    return model.eval()


def stop_token_ids(tokenizer: PreTrainedTokenizerBase, stop: list[str] | None) -> tuple[int, ...]:
    """Ids of the tokens that end a response: `stop`, or the tokenizer's end-of-sequence token."""
    if stop is None:
        return (tokenizer.eos_token_id,)
    ids = tuple(tokenizer.convert_tokens_to_ids(token) for token in stop)
    unknown = [token for token, i in zip(stop, ids) if i is None or i == tokenizer.unk_token_id]
    if unknown:
        raise ValueError(f"rollout.stop: {unknown} are not tokens of this tokenizer")
    return ids
