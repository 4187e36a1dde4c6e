"""Engines own their models: `build_train_engine` loads the stage's model from the checkpoint
folder (the policy for actor and reference stages, the critic for critic stages), and the Medusa
heads' engine keeps heads and optimizer state across a save and a load."""

from __future__ import annotations

import pytest
import torch

from stream_rlhf.algos.medusa import heads_loss
from stream_rlhf.backends.engines import build_train_engine
from stream_rlhf.backends.medusa_engine import MedusaTrainEngine
from stream_rlhf.backends.torch_engine import TorchTrainEngine
from stream_rlhf.config import build
from stream_rlhf.distributed import RankGroup
from stream_rlhf.experience import Experience
from stream_rlhf.models.checkpoint import build_tiny, load_policy, save_checkpoint
from stream_rlhf.models.model_config import TinyModelConfig
from stream_rlhf.models.tokenizer import build_tokenizer
from stream_rlhf.rl.config import RLJobConfig
from stream_rlhf.samples import pad_right
from tests.rl_tiny import tiny_job

TINY = TinyModelConfig(hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                       num_key_value_heads=1, head_dim=32)
SEQUENCES = [torch.tensor([1, 5, 6, 7, 8, 9]), torch.tensor([1, 8, 9, 10, 11])]
PROMPT_LENS = torch.tensor([2, 2], dtype=torch.int32)


@pytest.fixture
def checkpoint(tmp_path):
    tokenizer = build_tokenizer()
    folder = tmp_path / "policy"
    save_checkpoint(build_tiny(TINY, tokenizer, seed=0), tokenizer, folder)
    return str(folder)


def test_build_train_engine_loads_the_policy_or_the_critic_by_stage(tmp_path, checkpoint):
    cfg = build(RLJobConfig, tiny_job(tmp_path, "engines"))
    group = RankGroup.single()
    ref = build_train_engine(cfg, "ref_forward", checkpoint, group)
    expected = TorchTrainEngine(load_policy(checkpoint), group, None, cfg.precision).forward_logprobs(SEQUENCES, 1.0)
    for got, want in zip(ref.forward_logprobs(SEQUENCES, 1.0), expected):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    critic = build_train_engine(cfg, "critic_forward", checkpoint, group)
    values = critic.forward_values(SEQUENCES)
    assert [len(v) for v in values] == [len(s) - 1 for s in SEQUENCES]
    assert all(bool((v == 0).all()) for v in values)  # a new critic's value head starts at zero
    with pytest.raises(ValueError, match="stage 'reward_forward' holds no train engine"):
        build_train_engine(cfg, "reward_forward", checkpoint, group)


def _experience() -> Experience:
    mask = pad_right([torch.ones(len(s) - 2) for s in SEQUENCES], 0.0)
    return Experience(sequences=SEQUENCES, prompt_lens=PROMPT_LENS, mask=mask, behavior_logp=torch.zeros_like(mask),
                      old_logp=None, ref_logp=None, values=None, scores=torch.zeros(2), group_ids=torch.tensor([0, 1]),
                      policy_versions=torch.zeros(2))


def test_medusa_engine_trains_the_heads_and_resumes_them_exactly(tmp_path, checkpoint):
    engine = MedusaTrainEngine(checkpoint, num_heads=2, lr=1e-2, device="cpu")
    before = {k: v.clone() for k, v in engine.heads.state_dict().items()}
    metrics = engine.train_step(_experience(), heads_loss)
    assert {"loss", "head0_loss", "head0_acc", "head1_loss", "head1_acc"} <= set(metrics)
    assert any(not torch.equal(before[k], v) for k, v in engine.heads.state_dict().items())
    torch.save(engine.snapshot_state(), tmp_path / "medusa.pt")
    resumed = MedusaTrainEngine(checkpoint, num_heads=2, lr=1e-2, device="cpu")
    resumed.load_state(tmp_path / "medusa.pt")
    # the next step is the same from the saved state (heads and AdamW moments) as from the live one
    assert engine.train_step(_experience(), heads_loss) == resumed.train_step(_experience(), heads_loss)
    for name, value in engine.heads.state_dict().items():
        torch.testing.assert_close(resumed.heads.state_dict()[name], value, rtol=0, atol=0)
