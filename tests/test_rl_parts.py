"""The pieces between the algorithms and the stages: weight versions in shared memory, the
reward (rule-based and reward model combined), ragged samples and per-token rewards."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2ForSequenceClassification

from stream_rlhf.algos.config import KLConfig
from stream_rlhf.broker.control.messages import Handle
from stream_rlhf.config import build
from stream_rlhf.experience import Experience, IterationBuffer
from stream_rlhf.models.checkpoint import build_tiny
from stream_rlhf.models.model_config import TinyModelConfig
from stream_rlhf.models.tokenizer import build_tokenizer
from stream_rlhf.rl.config import RLJobConfig
from stream_rlhf.samples import Rollout, ragged, unragged
from stream_rlhf.stage import Batch
from stream_rlhf.stages.job_context import JobContext
from stream_rlhf.stages.reward_forward import Scorer
from stream_rlhf.weights.shm_store import WeightStore
from tests.rl_tiny import tiny_job
from tests.tiny_models import tiny_qwen2_config

TINY = TinyModelConfig(hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                       num_key_value_heads=1, head_dim=32)


def test_weight_store_versions_reach_a_reader_and_old_ones_go(tmp_path):
    tokenizer = build_tokenizer()
    trainer, reader = build_tiny(TINY, tokenizer, seed=1), build_tiny(TINY, tokenizer, seed=2)
    store = WeightStore(tmp_path, "actor", keep=2)
    assert store.latest_version() == -1 and store.refresh(reader, 0) == 0  # nothing yet: keeps v0
    for version in (1, 2, 3):
        with torch.no_grad():
            trainer.model.norm.weight.add_(1.0)
        store.publish(trainer, version)
    assert store.refresh(reader, 0) == 3
    for name, value in trainer.state_dict().items():
        torch.testing.assert_close(reader.state_dict()[name], value, msg=name)
    assert reader.lm_head.weight.data_ptr() == reader.model.embed_tokens.weight.data_ptr()  # still tied
    assert sorted(p.name for p in store.folder.glob("v*.safetensors")) == ["v2.safetensors", "v3.safetensors"]
    assert store.refresh(reader, 3) == 3


@pytest.mark.parametrize("workers", [0, 2])  # the function in the stage's process, or in 2 of its own
def test_reward_function_and_reward_model_combine(tmp_path, workers):
    tokenizer = build_tokenizer()
    checkpoint = tmp_path / "policy"
    build_tiny(TINY, tokenizer, seed=0).save_pretrained(checkpoint)
    tokenizer.save_pretrained(checkpoint)
    torch.manual_seed(0)
    rm = Qwen2ForSequenceClassification(tiny_qwen2_config(
        len(tokenizer), num_hidden_layers=1, intermediate_size=64, num_labels=1, pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    ))
    rm.save_pretrained(tmp_path / "rm")
    cfg = build(RLJobConfig, tiny_job(tmp_path, "r", reward={"function": "stream_rlhf.data.arithmetic:reward",
                                                             "function_weight": 1.0, "model_path": str(tmp_path / "rm"),
                                                             "model_weight": 0.5, "workers": workers}))
    scorer = Scorer(JobContext(cfg, str(checkpoint), ""))
    assert (scorer.pool is not None) == bool(workers)

    def encode(text):
        return torch.tensor(tokenizer.encode(text, add_special_tokens=False))

    prompts, responses = [encode("2+3="), encode("10+5=")], [encode("5"), encode("14")]
    rollout = Rollout([torch.cat([p, r]) for p, r in zip(prompts, responses)], torch.tensor([4, 5]),
                      [torch.zeros(1), torch.zeros(2)], torch.tensor([0, 1]))
    with scorer:
        scores = scorer.score(rollout, ["5", "15"])
    with torch.no_grad():
        model_scores = torch.stack([rm(input_ids=s[None]).logits[0, 0] for s in rollout.sequences])
    # "5" is right (1.0); "14" has the right length but is wrong (0.1)
    torch.testing.assert_close(scores, torch.tensor([1.0, 0.1]) + 0.5 * model_scores, atol=1e-5, rtol=0)


def test_ragged_fields_round_trip():
    values = [torch.arange(3), torch.arange(1), torch.arange(5)]
    fields = ragged("x", values)
    assert fields["x"].shape == (9,) and fields["x_lens"].tolist() == [3, 1, 5]
    assert [v.tolist() for v in unragged(fields, "x")] == [v.tolist() for v in values]


def test_token_rewards_put_the_score_on_the_last_token_and_the_kl_on_every_token():
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    old = torch.tensor([[-1.0, -1.0, -1.0], [-2.0, 0.0, 0.0]])
    ref = torch.tensor([[-1.5, -1.0, -0.5], [-1.0, 0.0, 0.0]])
    exp = Experience([torch.arange(5), torch.arange(3)], torch.tensor([2, 2]), mask, old, old, ref, None,
                     torch.tensor([1.0, 0.5]), torch.tensor([0, 1]), torch.tensor([0, 0]))
    rewards = exp.token_rewards(0.1, KLConfig(kind="k1", placement="reward"))
    # k1 = old - ref: [[0.5, 0, -0.5], [-1, -, -]]
    torch.testing.assert_close(rewards, torch.tensor([[-0.05, 0.0, 1.05], [0.6, 0.0, 0.0]]))
    no_kl = exp.token_rewards(0.1, KLConfig(placement="loss"))
    torch.testing.assert_close(no_kl, torch.tensor([[0.0, 0.0, 1.0], [0.5, 0.0, 0.0]]))


def test_iteration_buffer_take_newest_drops_what_it_skips_over():
    buffer = IterationBuffer(minibatches=2)
    for iteration, minibatch in [(0, 0), (1, 1), (1, 0), (2, 0)]:
        buffer.add(Batch(Handle(f"h{iteration}{minibatch}", "experience", iteration, minibatch, 0, 1), {}))
    batches, dropped = buffer.take_newest()
    assert [(b.iteration, b.minibatch) for b in batches] == [(1, 0), (1, 1)] and dropped == 1  # 0 was incomplete
    assert buffer.take_newest() is None  # iteration 2 still waits for its second mini-batch
