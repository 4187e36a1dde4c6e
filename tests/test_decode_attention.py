"""The sampler's decode attention and its KV cache: same results as Hugging Face's SDPA path."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from transformers import DynamicCache, Qwen2ForCausalLM
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from stream_rlhf.backends.decode_attention import NAME, decode_attention_forward, use_decode_attention
from stream_rlhf.backends.kv_cache import PreallocatedCache, cache_argument
from stream_rlhf.backends.torch_rollout import SamplingParams, generate
from tests.tiny_models import tiny_qwen2_config

VOCAB = 48


class _Attention(nn.Module):
    """What the attention functions read from the calling module."""

    def __init__(self, groups: int):
        super().__init__()
        self.num_key_value_groups = groups
        self.is_causal = True


@pytest.fixture(scope="module")
def lm() -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    return Qwen2ForCausalLM(tiny_qwen2_config(VOCAB, num_attention_heads=4, num_key_value_heads=2)).eval()


@pytest.mark.parametrize("q_len", [1, 3])
def test_decode_attention_equals_sdpa_with_grouped_heads_and_mask(q_len):
    g = torch.Generator().manual_seed(0)
    query = torch.randn(3, 4, q_len, 8, generator=g)  # (B, H, Q, D)
    key, value = torch.randn(3, 2, 6, 8, generator=g), torch.randn(3, 2, 6, 8, generator=g)  # (B, Hkv, K, D)
    mask = torch.rand(3, 1, q_len, 6, generator=g) > 0.3
    mask[..., 0] = True  # every query attends to something
    module = _Attention(groups=2).eval()
    ours, _ = decode_attention_forward(module, query, key, value, mask, scaling=0.3)
    theirs, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=0.3)
    assert ours.shape == theirs.shape == (3, q_len, 4, 8)
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-5)


@pytest.mark.slow
def test_generate_with_decode_attention_samples_what_sdpa_samples(lm):
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, VOCAB, (n,), generator=g) for n in (6, 1, 3, 9, 3)]
    params = SamplingParams(temperature=1.0, max_new_tokens=12)
    decoding = copy.deepcopy(lm)
    use_decode_attention(decoding)
    assert decoding.config._attn_implementation == NAME
    ours = generate(decoding, prompts, params, torch.Generator().manual_seed(5))
    theirs = generate(lm, prompts, params, torch.Generator().manual_seed(5))
    assert [r.tolist() for r in ours.response_ids] == [r.tolist() for r in theirs.response_ids]
    for a, b in zip(ours.response_logp, theirs.response_logp):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def test_cache_that_outgrows_its_capacity_gives_the_logits_of_a_dynamic_cache(lm):
    """Capacity 3 for a 5-token prompt and 4 decode steps: every layer grows together, before the
    mask is built, and attention never sees an unwritten slot."""
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(1, VOCAB, (2, 5), generator=g)
    attention = torch.ones(2, 5, dtype=torch.long)
    attention[1, :2] = 0  # left padding on the second row
    position_ids = (attention.cumsum(-1) - 1).clamp(min=0)
    small, dynamic = PreallocatedCache(capacity=3), DynamicCache()
    with torch.no_grad():
        outputs = [lm(ids, attention_mask=attention, position_ids=position_ids, **cache_argument(lm, cache),
                      use_cache=True).logits[:, -1] for cache in (small, dynamic)]
        torch.testing.assert_close(outputs[0], outputs[1], atol=1e-5, rtol=0)
        for step in range(4):
            token = outputs[0].argmax(-1, keepdim=True)  # (B, 1)
            attention = torch.cat([attention, torch.ones_like(token)], dim=1)
            position = position_ids[:, -1:] + 1 + step
            outputs = [lm(token, attention_mask=attention, position_ids=position, **cache_argument(lm, cache),
                          use_cache=True).logits[:, -1] for cache in (small, dynamic)]
            torch.testing.assert_close(outputs[0], outputs[1], atol=1e-5, rtol=0)
    assert small.get_seq_length() == dynamic.get_seq_length() == 9
    assert small.capacity >= 9 and all(layer.keys.shape[-2] == small.capacity for layer in small.layers)


def test_cropped_and_selected_rows_match_a_dynamic_cache(lm):
    """Speculative rollback (crop) and rows leaving the batch (batch_select_indices)."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, VOCAB, (3, 6), generator=g)
    caches = (PreallocatedCache(capacity=16), DynamicCache())
    with torch.no_grad():
        for cache in caches:
            lm(ids, attention_mask=torch.ones_like(ids), **cache_argument(lm, cache), use_cache=True)
            cache.crop(-2)  # 6 -> 4 positions
            cache.batch_select_indices(torch.tensor([2, 0]))
        token = torch.randint(1, VOCAB, (2, 1), generator=g)
        mask = torch.ones(2, 5, dtype=torch.long)
        logits = [lm(token, attention_mask=mask, position_ids=torch.full((2, 1), 4), **cache_argument(lm, cache),
                     use_cache=True).logits for cache in caches]
    torch.testing.assert_close(logits[0], logits[1], atol=1e-5, rtol=0)


def test_capacity_must_be_positive():
    with pytest.raises(ValueError, match="capacity=0"):
        PreallocatedCache(capacity=0)
