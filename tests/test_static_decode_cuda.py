"""`rollout.decode: graphs` on cuda:0 (fp32, TF32 off): every decode step of the torch sampler and
of Medusa's verification replayed from a CUDA graph captured per bucket.
- the graphs give the tokens and log-probs of the same static steps run eagerly (same kernels,
  same generator), plain and Medusa, fp32 and under bf16 autocast;
- greedy, they give the eager sampler's tokens (`torch_rollout.generate`, `generate_speculative`);
- steady state captures nothing: a second call over the same buckets leaves `captures` unchanged,
  and the count is one graph per (bucket, step kind, query length) used;
- the first call captures every smaller bucket its rows may move to (the ladder), so calls whose
  rows finish at other steps capture nothing either (the first call's tokens, taken while it
  captured the ladder over its own cache, are still the eager steps').
"""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2ForCausalLM

from stream_rlhf.backends.decode_attention import use_decode_attention
from stream_rlhf.backends.speculative import generate_speculative
from stream_rlhf.backends.speculative_static import generate_speculative_static
from stream_rlhf.backends.static_decode import StaticDecoder, static_decoder
from stream_rlhf.backends.static_sampler import generate_static
from stream_rlhf.backends.torch_rollout import Generation, SamplingParams, generate
from stream_rlhf.models.medusa import MedusaHeads
from tests.tiny_models import tiny_qwen2_config

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: graphs on cuda:0")]
CUDA = torch.device("cuda:0")
VOCAB = 48


@pytest.fixture(scope="module", autouse=True)
def fp32_only():
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


@pytest.fixture(scope="module")
def lm() -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(tiny_qwen2_config(VOCAB, initializer_range=0.3)).eval().to(CUDA)
    use_decode_attention(model)
    return model


def _prompts() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, VOCAB, (n,), generator=g) for n in (6, 1, 3, 9, 3)]
    return [p.to(CUDA) for p in prompts + [prompts[2].clone()]]


def _generator(seed: int = 0) -> torch.Generator:
    return torch.Generator(CUDA).manual_seed(seed)


def _assert_same(expected: Generation, got: Generation, atol: float = 1e-5) -> None:
    assert got.finish_reasons == expected.finish_reasons
    for a, b, la, lb in zip(expected.response_ids, got.response_ids, expected.response_logp, got.response_logp,
                            strict=True):
        assert a.tolist() == b.tolist()
        torch.testing.assert_close(lb, la, atol=atol, rtol=atol)


def test_auto_means_graphs_on_cuda(lm):
    assert static_decoder("auto", CUDA, lm).mode == "graphs"


@pytest.mark.parametrize("autocast", [False, True])
def test_graphed_sampler_gives_the_static_tokens_and_captures_once(lm, autocast):
    params = SamplingParams(0.8, 0.95, 16, (3, 5))
    graphs, static = StaticDecoder(graphs=True), StaticDecoder(graphs=False)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        first = generate_static(lm, graphs, _prompts(), params, _generator())
        captured = graphs.captures
        assert captured >= 1
        _assert_same(generate_static(lm, static, _prompts(), params, _generator()), first)
        again = generate_static(lm, graphs, _prompts(), params, _generator())
    assert graphs.captures == captured  # steady state: replays only
    assert captured <= len(graphs.caches)  # at most one graph per bucket ("sample": one token per step)
    _assert_same(first, again, atol=0)


def test_graphed_greedy_gives_the_eager_sampler_tokens(lm):
    params = SamplingParams(0.0, 1.0, 12, (3,))
    _assert_same(generate(lm, _prompts(), params), generate_static(lm, StaticDecoder(graphs=True), _prompts(), params))


def test_graphed_medusa_gives_the_static_and_eager_tokens(lm):
    heads = MedusaHeads.from_policy(lm, 3).eval().to(CUDA)
    graphs = StaticDecoder(graphs=True)
    params = SamplingParams(1.0, 1.0, 12, (3,))
    got, got_stats = generate_speculative_static(lm, heads, graphs, _prompts(), params, _generator())
    want, want_stats = generate_speculative_static(lm, heads, StaticDecoder(graphs=False), _prompts(), params,
                                                   _generator())
    _assert_same(want, got)
    assert got_stats == want_stats
    captured = graphs.captures
    generate_speculative_static(lm, heads, graphs, _prompts(), params, _generator())
    assert graphs.captures == captured
    greedy = SamplingParams(0.0, 1.0, 12, (3,))
    _assert_same(generate_speculative(lm, heads, _prompts(), greedy)[0],
                 generate_speculative_static(lm, heads, graphs, _prompts(), greedy)[0])


def test_the_first_batch_captures_every_bucket_a_later_one_moves_to(lm):
    params = SamplingParams(0.8, 0.95, 16, (3, 5))
    graphs = StaticDecoder(graphs=True)
    generate_static(lm, graphs, _prompts(), params, _generator(0))
    assert graphs.captures == 4  # 6 rows: "sample" in buckets of 8, 4, 2 and 1 slots
    heads = MedusaHeads.from_policy(lm, 3).eval().to(CUDA)
    generate_speculative_static(lm, heads, graphs, _prompts(), params, _generator(0))
    assert graphs.captures == 4 + 4 * 4  # "verify" of 1 to 4 tokens (3 heads) in each of the 4 buckets
    for seed in range(1, 6):  # other draws: rows finish at other steps and move to other buckets
        generate_static(lm, graphs, _prompts(), params, _generator(seed))
        generate_speculative_static(lm, heads, graphs, _prompts(), params, _generator(seed))
    assert graphs.captures == 20
