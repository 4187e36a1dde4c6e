"""The torch rollout backend: left padding, KV cache, sampling and behaviour log-probs."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from stream_rlhf.backends.torch_rollout import SamplingParams, generate
from stream_rlhf.models.packing import sequence_logprobs
from tests.tiny_models import tiny_qwen2_config, tiny_qwen3_config

VOCAB = 48
PAD = 0


@pytest.fixture(scope="module", params=[tiny_qwen2_config, tiny_qwen3_config], ids=["qwen2", "qwen3"])
def lm(request) -> PreTrainedModel:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(request.param(VOCAB)).eval()


@pytest.fixture
def prompts() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(1, VOCAB, (n,), generator=g) for n in (6, 1, 3, 9)]


def _greedy_without_cache(lm, prompt: torch.Tensor, n: int) -> torch.Tensor:
    ids = prompt.clone()
    with torch.no_grad():
        for _ in range(n):
            ids = torch.cat([ids, lm(ids[None]).logits[0, -1].argmax()[None]])
    return ids[prompt.numel() :]


def test_greedy_equals_uncached_argmax(lm, prompts):
    gen = generate(lm, prompts, SamplingParams(temperature=0, max_new_tokens=8, pad_token_id=PAD))
    assert gen.finish_reasons == ["length"] * len(prompts)
    for prompt, response in zip(prompts, gen.response_ids):
        assert torch.equal(response, _greedy_without_cache(lm, prompt, 8))


def test_behaviour_logp_equals_recomputed(lm, prompts):
    params = SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=10)
    gen = generate(lm, prompts, params, generator=torch.Generator().manual_seed(0))
    full = [torch.cat([p, r]) for p, r in zip(prompts, gen.response_ids)]
    recomputed, _ = sequence_logprobs(lm, full, temperature=0.7)
    for prompt, logp, again in zip(prompts, gen.response_logp, recomputed):
        torch.testing.assert_close(logp, again[prompt.numel() - 1 :], atol=1e-4, rtol=0)



def test_bf16_sampling_records_fp32_log_probs_near_the_fp32_forward(lm, prompts):
    """Under bf16 autocast (`precision: bf16`) the logits are cast back to fp32 before sampling:
    the behaviour log-probs are fp32, bf16-rounded against a fp32 forward of the same tokens."""
    params = SamplingParams(temperature=0.7, max_new_tokens=10)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        gen = generate(lm, prompts, params, generator=torch.Generator().manual_seed(0))
    full = [torch.cat([p, r]) for p, r in zip(prompts, gen.response_ids)]
    recomputed, _ = sequence_logprobs(lm, full, temperature=0.7)
    gaps = torch.cat([(logp - again[prompt.numel() - 1 :]).abs()
                      for prompt, logp, again in zip(prompts, gen.response_logp, recomputed)])
    assert all(logp.dtype == torch.float32 for logp in gen.response_logp)
    assert 0 < gaps.max() < 0.1

def test_stop_tokens_end_responses(lm, prompts):
    free = generate(lm, prompts, SamplingParams(temperature=0, max_new_tokens=8))
    stop = int(free.response_ids[0][3])
    gen = generate(lm, prompts, SamplingParams(temperature=0, max_new_tokens=8, stop_token_ids=(stop,)))
    for unstopped, response, reason in zip(free.response_ids, gen.response_ids, gen.finish_reasons):
        hits = (unstopped == stop).nonzero()
        if len(hits):
            assert reason == "stop" and torch.equal(response, unstopped[: int(hits[0]) + 1])
        else:
            assert reason == "length" and torch.equal(response, unstopped)
    assert gen.finish_reasons[0] == "stop" and int(gen.response_ids[0][-1]) == stop
    assert all(len(ids) == len(lp) for ids, lp in zip(gen.response_ids, gen.response_logp))


def test_rows_that_stop_leave_the_batch(lm, prompts):
    free = generate(lm, prompts, SamplingParams(temperature=0, max_new_tokens=8))
    stop = int(free.response_ids[0][1])
    rows_fed: list[int] = []  # per forward: the prefill, then one per decode step
    hook = lm.get_input_embeddings().register_forward_hook(lambda module, args, out: rows_fed.append(out.shape[0]))
    try:
        gen = generate(lm, prompts, SamplingParams(temperature=0, max_new_tokens=8, stop_token_ids=(stop,)))
    finally:
        hook.remove()
    assert "stop" in gen.finish_reasons and "length" in gen.finish_reasons
    lengths = [len(r) for r in gen.response_ids]
    # forward i feeds the rows whose response is longer than i tokens: those still decoding
    assert rows_fed == [sum(n > i for n in lengths) for i in range(max(lengths))]
    assert rows_fed[-1] < len(prompts)


def test_a_prompt_sampled_several_times_is_prefilled_once(lm, prompts):
    """Four copies of each prompt, interleaved: the prefill feeds the distinct prompts only, and
    every sample is what it would be from a prefill of its own (greedy: identical responses;
    sampled: behaviour log-probs equal the recomputed ones)."""
    repeated = [prompts[i % len(prompts)] for i in range(4 * len(prompts))]
    rows_fed: list[int] = []
    hook = lm.get_input_embeddings().register_forward_hook(lambda module, args, out: rows_fed.append(out.shape[0]))
    try:
        greedy = generate(lm, repeated, SamplingParams(temperature=0, max_new_tokens=5))
    finally:
        hook.remove()
    assert rows_fed == [len(prompts)] + [len(repeated)] * 4
    alone = generate(lm, prompts, SamplingParams(temperature=0, max_new_tokens=5))
    for i, response in enumerate(greedy.response_ids):
        assert torch.equal(response, alone.response_ids[i % len(prompts)])
    params = SamplingParams(temperature=1.0, max_new_tokens=6)
    gen = generate(lm, repeated, params, generator=torch.Generator().manual_seed(3))
    assert len({tuple(r.tolist()) for r in gen.response_ids}) > len(prompts)  # copies sample apart
    full = [torch.cat([p, r]) for p, r in zip(repeated, gen.response_ids)]
    recomputed, _ = sequence_logprobs(lm, full, temperature=1.0)
    for prompt, logp, again in zip(repeated, gen.response_logp, recomputed):
        torch.testing.assert_close(logp, again[prompt.numel() - 1 :], atol=1e-4, rtol=0)


def test_max_new_tokens_respected(lm, prompts):
    gen = generate(lm, prompts, SamplingParams(max_new_tokens=3), generator=torch.Generator().manual_seed(0))
    assert [len(r) for r in gen.response_ids] == [3] * len(prompts)
    assert [len(r) for r in gen.response_logp] == [3] * len(prompts)


def test_same_seed_same_samples(lm, prompts):
    params = SamplingParams(temperature=1.0, max_new_tokens=6)
    first = generate(lm, prompts, params, generator=torch.Generator().manual_seed(5))
    second = generate(lm, prompts, params, generator=torch.Generator().manual_seed(5))
    for a, b in zip(first.response_ids, second.response_ids):
        assert torch.equal(a, b)


def test_tiny_top_p_is_greedy(lm, prompts):
    greedy = generate(lm, prompts, SamplingParams(temperature=0, max_new_tokens=6))
    nucleus = generate(
        lm,
        prompts,
        SamplingParams(temperature=1.0, top_p=1e-6, max_new_tokens=6),
        generator=torch.Generator().manual_seed(0),
    )
    for a, b in zip(greedy.response_ids, nucleus.response_ids):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": -1.0}, "temperature=-1.0"),
        ({"top_p": 0}, "top_p=0"),
        ({"top_p": 1.5}, "top_p=1.5"),
        ({"max_new_tokens": 0}, "max_new_tokens=0"),
        ({"stop_token_ids": (-1,)}, "stop_token_ids"),
        ({"pad_token_id": -1}, "pad_token_id=-1"),
    ],
)
def test_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)
