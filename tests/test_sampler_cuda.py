"""The torch sampler's decode attention and preallocated KV cache on cuda:0 (fp32, TF32 off):
- greedy generation (the rollout engine's path: `use_decode_attention`, `generate`) gives on the GPU
  the tokens it gives on the CPU, with rows leaving the batch at a stop token and a prompt that
  comes twice (its cache rows copied), and the same behaviour log-probs to 1e-5;
- `stream_rlhf_decode` attention equals Hugging Face's eager attention on CUDA tensors (grouped
  heads, a padding mask), and a model decoding through it samples what the eager model samples
  with the same CUDA generator.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import Qwen2ForCausalLM
from transformers.models.qwen2.modeling_qwen2 import eager_attention_forward

from stream_rlhf.backends.decode_attention import NAME, decode_attention_forward, use_decode_attention
from stream_rlhf.backends.torch_rollout import SamplingParams, generate
from tests.test_decode_attention import VOCAB, _Attention
from tests.tiny_models import tiny_qwen2_config

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: the sampler on cuda:0")]
CUDA = torch.device("cuda:0")


@pytest.fixture(scope="module", autouse=True)
def fp32_only():
    """No TF32 while these tests run: the GPU must give the CPU's fp32 numbers."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


@pytest.fixture(scope="module")
def lm() -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    return Qwen2ForCausalLM(tiny_qwen2_config(VOCAB, num_attention_heads=4, num_key_value_heads=2)).eval()


def _decoding(lm: Qwen2ForCausalLM, device: torch.device, attention: str = NAME) -> Qwen2ForCausalLM:
    model = copy.deepcopy(lm).to(device)
    if attention == NAME:
        use_decode_attention(model)
    else:
        model.set_attn_implementation(attention)
    return model


def _prompts() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, VOCAB, (n,), generator=g) for n in (6, 1, 3, 9, 3)]
    return prompts + [prompts[2].clone()]  # one prompt twice: prefilled once, its cache rows copied


def test_greedy_generation_on_cuda_gives_the_cpu_tokens(lm):
    prompts = _prompts()
    free = generate(_decoding(lm, torch.device("cpu")), prompts, SamplingParams(temperature=0, max_new_tokens=16))
    stop = int(free.response_ids[0][5])  # rows that sample it leave the batch with their cache rows
    params = SamplingParams(temperature=0, max_new_tokens=16, stop_token_ids=(stop,))
    cpu = generate(_decoding(lm, torch.device("cpu")), prompts, params)
    gpu = generate(_decoding(lm, CUDA), prompts, params)
    assert "stop" in cpu.finish_reasons and "length" in cpu.finish_reasons  # both exits are exercised
    assert [r.tolist() for r in gpu.response_ids] == [r.tolist() for r in cpu.response_ids]
    assert gpu.finish_reasons == cpu.finish_reasons
    for a, b in zip(gpu.response_logp, cpu.response_logp, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_decode_attention_equals_eager_attention_on_cuda(kv_heads):
    g = torch.Generator(device=CUDA).manual_seed(0)
    query = torch.randn(5, 4, 1, 32, generator=g, device=CUDA)  # (B, H, 1, D): one decode step
    key = torch.randn(5, kv_heads, 40, 32, generator=g, device=CUDA)  # (B, Hkv, K, D)
    value = torch.randn(5, kv_heads, 40, 32, generator=g, device=CUDA)
    attend = torch.rand(5, 1, 1, 40, generator=g, device=CUDA) > 0.3  # bool, True = attend
    attend[..., 0] = True
    additive = torch.zeros(attend.shape, device=CUDA).masked_fill(attend.logical_not(), float("-inf"))
    module = _Attention(groups=4 // kv_heads).eval()
    ours, _ = decode_attention_forward(module, query, key, value, attend, scaling=32**-0.5)
    theirs, _ = eager_attention_forward(module, query, key, value, additive, scaling=32**-0.5)
    assert ours.shape == theirs.shape == (5, 1, 4, 32)
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-5)


def test_sampling_through_decode_attention_on_cuda_equals_eager(lm):
    prompts = _prompts()
    params = SamplingParams(temperature=1.0, max_new_tokens=12)
    ours = generate(_decoding(lm, CUDA), prompts, params, torch.Generator(device=CUDA).manual_seed(5))
    theirs = generate(_decoding(lm, CUDA, "eager"), prompts, params, torch.Generator(device=CUDA).manual_seed(5))
    assert [r.tolist() for r in ours.response_ids] == [r.tolist() for r in theirs.response_ids]
    for a, b in zip(ours.response_logp, theirs.response_logp, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
