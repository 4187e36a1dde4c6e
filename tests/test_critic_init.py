"""The critic's start and warm-up: a critic loaded from the reward model (its backbone and scalar
head, refused for another architecture), the config checks of `critic.*`, and admission while
the warm-up keeps the policy at version 0."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForSequenceClassification

from stream_rlhf.broker.control.admission import OverlapAdmission
from stream_rlhf.broker.control.messages import Handle
from stream_rlhf.config import ConfigError, build
from stream_rlhf.models.checkpoint import build_tiny, load_critic_from_reward_model, save_checkpoint
from stream_rlhf.models.model_config import TinyModelConfig
from stream_rlhf.models.tokenizer import build_tokenizer
from stream_rlhf.rl.config import RLJobConfig
from stream_rlhf.rl.reward_parts_config import policy_version_at

TINY = TinyModelConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                       num_key_value_heads=1, head_dim=32, max_position_embeddings=32)


def tiny_folder(folder: Path, tiny: TinyModelConfig, seed: int = 0) -> Path:
    tokenizer = build_tokenizer()
    save_checkpoint(build_tiny(tiny, tokenizer, seed), tokenizer, folder)
    return folder


def reward_folder(folder: Path, policy: Path) -> Path:
    """A sequence-classification model of the policy's architecture with a random scalar head."""
    torch.manual_seed(1)
    model = AutoModelForSequenceClassification.from_pretrained(str(policy), num_labels=1)
    model.save_pretrained(folder)
    return folder


def test_a_critic_from_the_reward_model_values_the_last_token_as_the_reward_model_scores(tmp_path):
    policy = tiny_folder(tmp_path / "policy", TINY)
    scorer_dir = reward_folder(tmp_path / "reward", policy)
    critic = load_critic_from_reward_model(scorer_dir, policy).eval()
    scorer = AutoModelForSequenceClassification.from_pretrained(str(scorer_dir)).eval()
    ids = torch.tensor([[1, 5, 6, 40, 7, 2], [1, 8, 40, 9, 2, 0]])  # (2, 6); row 1 right-padded
    mask = (ids != 0).long()
    mask[0, 0] = 1
    with torch.no_grad():
        values = critic(input_ids=ids, attention_mask=mask).logits[..., 0]  # (2, 6)
        scores = scorer(input_ids=ids, attention_mask=mask).logits[:, 0]  # (2,) at each row's last token
    assert torch.allclose(values[0, 5], scores[0], atol=1e-5) and torch.allclose(values[1, 4], scores[1], atol=1e-5)
    assert critic.score.bias.abs().sum() == 0 and critic.score.weight.abs().sum() > 0
    assert all(m.p == 0.0 for m in critic.modules() if isinstance(m, torch.nn.Dropout))


def test_a_reward_model_of_another_architecture_is_refused_naming_the_differences(tmp_path):
    policy = tiny_folder(tmp_path / "policy", TINY)
    other = tiny_folder(tmp_path / "other", TinyModelConfig(**{**TINY.__dict__, "hidden_size": 96}))
    with pytest.raises(ValueError, match=r"critic.init=reward_model: reward.model_path=.*other.* does not match the "
                                         r"policy .*\(hidden_size: 96 != 64\)"):
        load_critic_from_reward_model(reward_folder(tmp_path / "reward", other), policy)


def test_critic_config_checks_and_the_learning_rate_warning(tmp_path, caplog):
    base = {"name": "c", "runs_dir": str(tmp_path)}
    with pytest.raises(ConfigError, match="critic.init=reward_model: needs reward.model_path"):
        build(RLJobConfig, {**base, "critic": {"init": "reward_model"}})
    with pytest.raises(ConfigError, match="critic.warmup_iterations=20: leaves none of the iterations=20"):
        build(RLJobConfig, {**base, "critic": {"warmup_iterations": 20}})
    with pytest.raises(ConfigError, match="critic.warmup_iterations=-1: must be >= 0"):
        build(RLJobConfig, {**base, "critic": {"warmup_iterations": -1}})
    with pytest.raises(ConfigError, match="critic.warmup_iterations=2: algorithm.advantage=grpo has no critic"):
        build(RLJobConfig, {**base, "algorithm": {"advantage": "grpo"}, "rollout_batch": {"samples_per_prompt": 2},
                            "critic": {"warmup_iterations": 2}})
    with caplog.at_level(logging.WARNING, logger="stream_rlhf"):
        build(RLJobConfig, {**base, "actor": {"lr": 1e-3}, "critic": {"lr": 1e-3}})
        assert not caplog.records  # equal rates: no warning
        cfg = build(RLJobConfig, {**base, "actor": {"lr": 2e-3}, "critic": {"lr": 1e-3, "warmup_iterations": 3}})
    assert [r.getMessage() for r in caplog.records] == [
        "actor.lr=0.002 is above critic.lr=0.001: PPO tends to diverge when the policy moves faster than its value "
        "estimates follow"]
    assert cfg.critic.warmup_iterations == 3 and cfg.critic.max_grad_norm == 1.0  # the optimizer keys stay


def handle(iteration: int) -> Handle:
    return Handle(id=f"h{iteration}", topic="prompts", iteration=iteration, minibatch=0, policy_version=0,
                  num_samples=1)


def test_admission_during_a_critic_warm_up_keeps_the_staleness_bound():
    # W = 2, depth 1: iterations 0 and 1 warm the critic up at version 0, iteration 2 trains version 0
    # (publishes 1), iteration 3 trains version 1; a sample may be at most one version behind
    assert [policy_version_at(i, 2) for i in range(5)] == [0, 0, 0, 1, 2]
    admission = OverlapAdmission(frozenset({"prompts"}), overlap_depth=1, warmup_iterations=2)
    admitted = {v: [i for i in range(7) if admission.admit(handle(i), "rollout", v)] for v in range(3)}
    assert admitted == {0: [0, 1, 2, 3], 1: [0, 1, 2, 3, 4], 2: [0, 1, 2, 3, 4, 5]}
    for version, iterations in admitted.items():  # every admitted sample is trained within the bound
        assert all(policy_version_at(i, 2) - version <= 1 for i in iterations)
    on_policy = OverlapAdmission(frozenset({"prompts"}), overlap_depth=0, warmup_iterations=2)
    assert [i for i in range(5) if on_policy.admit(handle(i), "rollout", 0)] == [0, 1, 2]
