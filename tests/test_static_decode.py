"""Static-cache decoding (`rollout.decode: static`) on the CPU: the same tokens as the eager
sampler for the same seed (plain, Medusa and eval), slot-addressed rows that join mid-decode, and
no new cache in steady state. The CUDA-graph mode: tests/test_static_decode_cuda.py."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2ForCausalLM

from stream_rlhf.backends.decode_attention import use_decode_attention
from stream_rlhf.backends.kv_cache import PreallocatedCache, cache_argument
from stream_rlhf.backends.slot_cache import SlotCache
from stream_rlhf.backends.speculative import generate_speculative
from stream_rlhf.backends.speculative_static import generate_speculative_static
from stream_rlhf.backends.static_decode import StaticDecoder, capacity_bucket, slot_bucket, static_decoder
from stream_rlhf.backends.static_sampler import generate_static
from stream_rlhf.backends.torch_rollout import SamplingParams, generate
from stream_rlhf.config import ConfigError, build
from stream_rlhf.driver.evaluate import evaluate
from stream_rlhf.models.checkpoint import build_tiny, save_checkpoint
from stream_rlhf.models.medusa import MedusaHeads
from stream_rlhf.models.model_config import TinyModelConfig
from stream_rlhf.models.tokenizer import build_tokenizer
from stream_rlhf.rl.config import RLJobConfig
from tests.tiny_models import tiny_qwen2_config

VOCAB = 48
CASES = [  # temperature, top_p, stop tokens, max new tokens
    (0.0, 1.0, (), 12), (0.7, 0.9, (5, 7), 12), (1.0, 1.0, (3,), 9), (1.0, 1.0, (), 1)]


@pytest.fixture(scope="module")
def lm() -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(tiny_qwen2_config(VOCAB, initializer_range=0.3)).eval()
    use_decode_attention(model)
    return model


@pytest.fixture(scope="module")
def prompts() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    distinct = [torch.randint(1, VOCAB, (n,), generator=g) for n in (6, 1, 3, 9, 2, 5)]
    return distinct + [distinct[0].clone(), distinct[3].clone()]  # two prompts sampled twice, as in GRPO


def _assert_same(eager, static) -> None:
    assert static.finish_reasons == eager.finish_reasons
    for a, b, la, lb in zip(eager.response_ids, static.response_ids, eager.response_logp, static.response_logp,
                            strict=True):
        assert torch.equal(a, b)
        torch.testing.assert_close(lb, la, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("temperature", "top_p", "stop", "max_new"), CASES)
def test_static_sampler_gives_the_eager_tokens(lm, prompts, temperature, top_p, stop, max_new):
    params = SamplingParams(temperature, top_p, max_new, stop)
    eager = generate(lm, prompts, params, torch.Generator().manual_seed(0))
    static = generate_static(lm, StaticDecoder(graphs=False), prompts, params, torch.Generator().manual_seed(0))
    _assert_same(eager, static)


def test_rows_that_stop_move_to_smaller_buckets_and_steady_state_allocates_nothing(lm, prompts):
    params = SamplingParams(1.0, 1.0, 12, (3, 5, 7))
    static = StaticDecoder(graphs=False)
    gens = [generate_static(lm, static, prompts, params, torch.Generator().manual_seed(s)) for s in (0, 1)]
    buckets = dict(static.caches)
    assert (8, 64) in buckets and len(buckets) > 1, "stopped rows left the 8-slot bucket for a smaller one"
    for seed, gen in enumerate(gens):
        _assert_same(generate(lm, prompts, params, torch.Generator().manual_seed(seed)), gen)
    generate_static(lm, static, prompts, params, torch.Generator().manual_seed(0))
    assert static.caches == buckets and all(static.caches[k] is buckets[k] for k in buckets)
    assert static.captures == 0  # no graph on the CPU


@pytest.mark.parametrize(("heads_kind", "temperature", "top_p", "stop", "max_new"), [
    ("policy", *CASES[0]), ("random", *CASES[1]), ("policy", *CASES[2]), ("random", *CASES[3])])
def test_static_medusa_gives_the_eager_tokens_and_stats(lm, prompts, heads_kind, temperature, top_p, stop, max_new):
    heads = MedusaHeads.from_policy(lm, 3)
    if heads_kind == "random":  # drafts that are rejected at every depth: every kind of rollback
        g = torch.Generator().manual_seed(3)
        with torch.no_grad():
            for p in heads.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    params = SamplingParams(temperature, top_p, max_new, stop)
    eager, eager_stats = generate_speculative(lm, heads.eval(), prompts, params, torch.Generator().manual_seed(0))
    static, static_stats = generate_speculative_static(lm, heads, StaticDecoder(graphs=False), prompts, params,
                                                       torch.Generator().manual_seed(0))
    _assert_same(eager, static)
    assert static_stats == eager_stats


def test_a_row_joining_a_busy_cache_decodes_as_alone(lm):
    """Slots are addressed one by one: a row prefilled into slot 1 while slot 0 is 3 steps into its
    own decode gets the logits it gets alone (issue 34's rows joining a running batch)."""
    decoder, lm_head = lm.get_decoder(), lm.get_output_embeddings()
    first, second = torch.tensor([[4, 9, 2, 11, 6]]), torch.tensor([[8, 1, 30]])

    def prefill(prompt: torch.Tensor) -> PreallocatedCache:
        cache = PreallocatedCache(prompt.shape[1])
        decoder(input_ids=prompt, **cache_argument(decoder, cache), use_cache=True)
        return cache

    def step(cache: SlotCache, tokens: list[int], positions: list[int]) -> torch.Tensor:
        mask = cache.begin(1)
        hidden = decoder(input_ids=torch.tensor(tokens)[:, None], attention_mask=mask,
                         position_ids=torch.tensor(positions)[:, None], **cache_argument(decoder, cache),
                         use_cache=True).last_hidden_state
        return lm_head(hidden[:, -1])  # (S, V)

    with torch.inference_mode():
        alone = SlotCache(slots=2, capacity=16)
        alone.join(torch.tensor([1]), prefill(second), torch.tensor([0]), torch.ones(1, 3))
        expected = step(alone, [0, 13], [0, 3])[1]
        busy = SlotCache(slots=2, capacity=16)
        busy.join(torch.tensor([0]), prefill(first), torch.tensor([0]), torch.ones(1, 5))
        for position in range(5, 8):
            step(busy, [position, 0], [position, 0])
            busy.commit(torch.tensor([1, 0]))
        busy.join(torch.tensor([1]), prefill(second), torch.tensor([0]), torch.ones(1, 3))
        assert busy.columns.tolist() == [8, 3]
        torch.testing.assert_close(step(busy, [17, 13], [8, 3])[1], expected, atol=1e-5, rtol=0)


def test_buckets_and_modes():
    assert [slot_bucket(n) for n in (1, 2, 3, 8, 9, 64, 65)] == [1, 2, 4, 8, 16, 64, 128]
    assert [capacity_bucket(n) for n in (1, 64, 65, 200)] == [64, 64, 128, 256]
    model = Qwen2ForCausalLM(tiny_qwen2_config(VOCAB))
    cpu = torch.device("cpu")
    assert static_decoder("auto", cpu, model) is None and static_decoder("eager", cpu, model) is None
    assert static_decoder("static", cpu, model).mode == "static"
    with pytest.raises(ConfigError, match="rollout.decode=graphs: CUDA graphs need a CUDA device"):
        static_decoder("graphs", cpu, model)


def test_eval_decodes_the_same_responses_static_and_eager(tmp_path):
    tokenizer = build_tokenizer()
    save_checkpoint(build_tiny(TinyModelConfig(), tokenizer, seed=0), tokenizer, tmp_path)
    results = {}
    for mode in ("eager", "static"):
        cfg = build(RLJobConfig, {"name": "eval_decode", "rollout": {"decode": mode, "max_new_tokens": 6},
                                  "task": {"eval_prompts": 24}})
        results[mode] = evaluate(cfg, str(tmp_path), batch_size=16)
    assert results["static"].pop("decode") == "static" and results["eager"].pop("decode") == "eager"
    assert results["static"] == results["eager"]
    assert 0 < results["eager"]["response_tokens"] < 2 * 24 * 6  # some responses stopped early
