"""vLLM (CPU build) serving a tiny Qwen3: behaviour log-probs equal our forward's, and weight
updates (the shared-memory store, a gloo broadcast) reach it, with its per-head query and key norms
among the tensors sent. Qwen3-VL through vLLM is in test_vllm_multimodal.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from stream_rlhf.backends import vllm_protocol as wire
from stream_rlhf.backends.vllm_client import VllmClient
from stream_rlhf.backends.vllm_rollout import VllmOptions
from stream_rlhf.models.checkpoint import build_tiny, load_policy, save_checkpoint
from stream_rlhf.models.model_config import TinyModelConfig
from stream_rlhf.models.tokenizer import build_tokenizer
from stream_rlhf.stages.weight_sync import trained_parameters
from stream_rlhf.weights.shm_store import WeightStore
from stream_rlhf.weights.transport import TRANSPORTS
from tests.test_vllm_rollout import PROMPTS, link, logprob_error, params, perturbed
from tests.vllm_env import vllm_python

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tiny_qwen3")
    tokenizer = build_tokenizer()
    cfg = TinyModelConfig(architecture="qwen3", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=64)
    save_checkpoint(build_tiny(cfg, tokenizer, seed=0), tokenizer, folder)
    return folder


@pytest.fixture(scope="module")
def engine(checkpoint):
    client = VllmClient(str(checkpoint), VllmOptions(max_model_len=64, cpu_cores=[0]), python=vllm_python(),
                        start_timeout_s=300)
    yield client
    client.close()
    assert client.process.returncode == 0


@pytest.fixture(scope="module")
def prompts() -> list[torch.Tensor]:
    tokenizer = build_tokenizer()
    return [torch.tensor(tokenizer.encode(p)) for p in PROMPTS]


def test_behaviour_logprobs_equal_our_forward(engine, checkpoint, prompts):
    gen = engine.generate(prompts, params(0.7), seeds=list(range(len(prompts))))
    assert logprob_error(load_policy(checkpoint).eval(), prompts, gen, 0.7) < 1e-4


def test_updates_reach_the_engine_through_the_store_and_a_broadcast(engine, checkpoint, prompts, tmp_path):
    seeds = list(range(len(prompts)))
    v1 = perturbed(load_policy(checkpoint).eval(), seed=1)
    with torch.no_grad():  # the norms move too: a missed q_norm / k_norm would show
        for layer in v1.model.layers:
            layer.self_attn.q_norm.weight.mul_(1.5)
            layer.self_attn.k_norm.weight.mul_(0.7)
    store = WeightStore(tmp_path, "actor")
    store.publish(v1, version=1)
    assert logprob_error(v1, prompts, engine.generate(prompts, params(), seeds), 1.0) > 1e-2
    engine.join_weights("shm", link(tmp_path), "rollout-0", 2)
    engine.update(1, wire.RECEIVE, 1)
    assert logprob_error(v1, prompts, engine.generate(prompts, params(), seeds), 1.0) < 1e-4

    v2 = perturbed(v1, seed=2)
    sent = dict(trained_parameters(v2))
    assert "model.layers.0.self_attn.q_norm.weight" in sent
    sender = TRANSPORTS["broadcast"].open_sender(link(tmp_path / "broadcast"), {"rollout-0": 2})
    try:
        engine.join_weights("broadcast", link(tmp_path / "broadcast"), "rollout-0", 2)
        sender.publish(sent.items(), version=2)
        engine.update(2, wire.RECEIVE, 2)
        sender.check()
    finally:
        sender.close()
    gen = engine.generate(prompts, params(), seeds)
    assert engine.version == 2 and logprob_error(v2, prompts, gen, 1.0) < 1e-4
