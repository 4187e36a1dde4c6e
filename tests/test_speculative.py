"""Speculative rollout with Medusa heads: the same tokens as plain decoding when greedy, the same
distribution when sampling (chi-square against exact probabilities), the same behaviour log-probs."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import Qwen2ForCausalLM

from stream_rlhf.backends import speculative
from stream_rlhf.backends.speculative import generate_speculative
from stream_rlhf.backends.torch_rollout import SamplingParams, generate, sampling_probs
from stream_rlhf.models.medusa import MedusaHeads
from stream_rlhf.models.packing import sequence_logprobs
from stream_rlhf.models.tokenizer import build_tokenizer
from tests.tiny_models import tiny_qwen2_config

VOCAB = len(build_tokenizer())  # 49
K = 3
TRAIN_TOKENS = 16
# initializer_range 0.3: peaked next-token distributions and greedy continuations that do not just
# repeat one token (with the default 0.02 the LM-head copies would predict them perfectly)
INIT = 0.3


def _random_heads(hidden_size: int, vocab_size: int, num_heads: int, seed: int, std: float) -> MedusaHeads:
    heads = MedusaHeads(hidden_size, vocab_size, num_heads)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in heads.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * std)
    return heads.eval()


def _train_heads(lm: Qwen2ForCausalLM, prompts: list[torch.Tensor]) -> MedusaHeads:
    """Heads fitted (300 full-batch Adam steps) to the model's greedy continuations of `prompts`."""
    gen = generate(lm, prompts, SamplingParams(temperature=0, max_new_tokens=TRAIN_TOKENS))
    hidden, targets = [], []
    with torch.no_grad():
        for prompt, response in zip(prompts, gen.response_ids):
            seq = torch.cat([prompt, response])
            h = lm.get_decoder()(seq[None]).last_hidden_state[0]  # (L, H)
            for t in range(len(prompt) - 1, len(seq) - 2):  # head k at t predicts t + 2 + k
                hidden.append(h[t])
                targets.append([int(seq[t + 2 + k]) if t + 2 + k < len(seq) else -100 for k in range(K)])
    hidden_t, targets_t = torch.stack(hidden), torch.tensor(targets).T  # (N, H), (K, N)
    return _fit(MedusaHeads.from_policy(lm, K), hidden_t, targets_t, steps=300)


def _fit(heads: MedusaHeads, hidden: torch.Tensor, targets: torch.Tensor, steps: int) -> MedusaHeads:
    """`steps` Adam steps of the heads on hidden states (N, H) and per-head targets (K, N), -100 = none."""
    torch.manual_seed(0)
    opt = torch.optim.Adam(heads.parameters(), lr=1e-2)
    for _ in range(steps):
        loss = nn.functional.cross_entropy(heads(hidden).flatten(0, 1), targets.flatten(), ignore_index=-100)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return heads.eval()


@pytest.fixture(scope="module")
def lm() -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    return Qwen2ForCausalLM(tiny_qwen2_config(VOCAB, initializer_range=INIT)).eval()


@pytest.fixture(scope="module")
def prompts() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(1, VOCAB, (n,), generator=g) for n in (6, 1, 3, 9, 2, 5, 7, 4, 8, 1, 3, 6)]


@pytest.fixture(scope="module")
def all_heads(lm, prompts) -> dict[str, MedusaHeads]:
    g = torch.Generator().manual_seed(2)
    others = [torch.randint(1, VOCAB, (n,), generator=g) for n in torch.randint(1, 10, (52,), generator=g).tolist()]
    return {
        "random": _random_heads(64, VOCAB, K, seed=3, std=0.2),
        "policy": MedusaHeads.from_policy(lm, K),
        "trained": _train_heads(lm, prompts + others),
    }


def _assert_same(plain, spec, atol: float = 1e-5) -> None:
    assert spec.finish_reasons == plain.finish_reasons
    for a, b, la, lb in zip(plain.response_ids, spec.response_ids, plain.response_logp, spec.response_logp):
        assert torch.equal(a, b)
        torch.testing.assert_close(lb, la, atol=atol, rtol=0)


@pytest.mark.parametrize("kind", ["random", "policy", "trained"])
@pytest.mark.parametrize("max_new_tokens", [1, 2, 7, 16])
def test_greedy_equals_generate(lm, prompts, all_heads, kind, max_new_tokens):
    params = SamplingParams(temperature=0, max_new_tokens=max_new_tokens)
    gen, stats = generate_speculative(lm, all_heads[kind], prompts, params)
    _assert_same(generate(lm, prompts, params), gen)
    assert stats.tokens == max_new_tokens * len(prompts)
    assert 1 <= stats.mean_accept_len <= K + 1


def test_greedy_rows_accepting_differently(lm, prompts, all_heads):
    """Rows the trained heads know (all drafts accepted) beside unseen ones (mostly rejected): the
    cache gets holes of every width and each row still decodes as alone."""
    g = torch.Generator().manual_seed(9)
    unseen = [torch.randint(1, VOCAB, (n,), generator=g) for n in (4, 2, 7, 1, 5, 3)]
    mixed = [x for pair in zip(prompts[:6], unseen) for x in pair]
    params = SamplingParams(temperature=0, max_new_tokens=TRAIN_TOKENS + 4)
    gen, stats = generate_speculative(lm, all_heads["trained"], mixed, params)
    _assert_same(generate(lm, mixed, params), gen)
    assert 0.1 < stats.acceptance_rate < 0.9


@pytest.mark.parametrize("position", [2, 5, 6])
def test_greedy_stop_tokens_cut_mid_draft(lm, prompts, all_heads, position):
    """Stop tokens taken from inside responses: rows end at different steps, some mid accepted run."""
    free = generate(lm, prompts, SamplingParams(temperature=0, max_new_tokens=TRAIN_TOKENS))
    stops = (int(free.response_ids[0][position]), int(free.response_ids[3][position + 1]))
    params = SamplingParams(temperature=0, max_new_tokens=TRAIN_TOKENS, stop_token_ids=stops, pad_token_id=0)
    plain = generate(lm, prompts, params)
    assert "stop" in plain.finish_reasons and "length" in plain.finish_reasons
    for kind in ("trained", "random"):
        gen, stats = generate_speculative(lm, all_heads[kind], prompts, params)
        _assert_same(plain, gen)
        assert stats.tokens == sum(len(r) for r in plain.response_ids)


def test_finished_rows_leave_the_batch(lm, prompts, all_heads):
    free = generate(lm, prompts, SamplingParams(temperature=0, max_new_tokens=TRAIN_TOKENS))
    params = SamplingParams(temperature=0, max_new_tokens=TRAIN_TOKENS, stop_token_ids=(int(free.response_ids[0][2]),))
    rows_fed: list[int] = []  # per backbone forward: the prefill, then one per verification step
    hook = lm.get_input_embeddings().register_forward_hook(lambda module, args, out: rows_fed.append(out.shape[0]))
    try:
        gen, stats = generate_speculative(lm, all_heads["random"], prompts, params)
    finally:
        hook.remove()
    assert "stop" in gen.finish_reasons
    assert rows_fed[0] == len(prompts) and rows_fed[-1] < len(prompts)
    assert rows_fed[1:] == sorted(rows_fed[1:], reverse=True)
    assert stats.row_steps == sum(rows_fed[1:])  # only rows still decoding are fed


@pytest.mark.parametrize("kind", ["random", "trained"])
def test_behaviour_logp_equals_recomputed(lm, prompts, all_heads, kind):
    params = SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=12)
    gen, _ = generate_speculative(lm, all_heads[kind], prompts, params, generator=torch.Generator().manual_seed(0))
    assert [len(r) for r in gen.response_ids] == [12] * len(prompts)
    full = [torch.cat([p, r]) for p, r in zip(prompts, gen.response_ids)]
    recomputed, _ = sequence_logprobs(lm, full, temperature=0.7)
    for prompt, logp, again in zip(prompts, gen.response_logp, recomputed):
        torch.testing.assert_close(logp, again[prompt.numel() - 1 :], atol=1e-4, rtol=0)


def test_sampling_stops_and_is_reproducible(lm, prompts, all_heads):
    free = generate(lm, prompts, SamplingParams(temperature=0, max_new_tokens=8))
    stop = int(free.response_ids[0][3])
    params = SamplingParams(temperature=1.0, max_new_tokens=12, stop_token_ids=(stop,))
    first, _ = generate_speculative(lm, all_heads["trained"], prompts, params, torch.Generator().manual_seed(4))
    again, _ = generate_speculative(lm, all_heads["trained"], prompts, params, torch.Generator().manual_seed(4))
    _assert_same(first, again, atol=0)
    for response, reason in zip(first.response_ids, first.finish_reasons):
        hits = (response == stop).nonzero()
        assert (reason == "stop") == (len(hits) > 0)
        assert len(hits) == 0 or (len(hits) == 1 and int(hits[0]) == len(response) - 1)
        assert reason == "stop" or len(response) == 12


def test_stats_acceptance_low_for_lm_head_copies_high_for_trained(lm, prompts, all_heads):
    params = SamplingParams(temperature=0, max_new_tokens=TRAIN_TOKENS)
    _, policy = generate_speculative(lm, all_heads["policy"], prompts, params)
    _, trained = generate_speculative(lm, all_heads["trained"], prompts, params)
    assert policy.acceptance_rate < 0.3 and trained.acceptance_rate > 0.8
    assert 1 <= policy.mean_accept_len < 1.5 and 3 < trained.mean_accept_len <= K + 1
    # every row runs 15 tokens after the prefill: all rows step together, K + 1 tokens at most per step
    assert trained.verify_steps < policy.verify_steps <= TRAIN_TOKENS - 1
    assert trained.verify_steps >= (TRAIN_TOKENS - 1) / (K + 1)
    for stats in (policy, trained):
        assert stats.tokens == TRAIN_TOKENS * len(prompts)
        assert stats.drafts_accepted <= stats.drafts_proposed <= K * stats.row_steps
        assert stats.mean_accept_len == pytest.approx(1 + stats.drafts_accepted / stats.row_steps)


def test_bad_inputs(lm, all_heads):
    gen, stats = generate_speculative(lm, all_heads["policy"], [], SamplingParams())
    assert gen.response_ids == [] and stats.verify_steps == 0
    with pytest.raises(ValueError, match="vocab_size=50"):
        generate_speculative(lm, MedusaHeads(64, VOCAB + 1, K), [torch.tensor([1])], SamplingParams())
    with pytest.raises(ValueError, match="at least one token"):
        generate_speculative(lm, all_heads["policy"], [torch.tensor([], dtype=torch.long)], SamplingParams())


# ------------------------------------------------------------------------------------------------
# Distribution: chi-square of speculative samples against exact probabilities of the backbone
# ------------------------------------------------------------------------------------------------

SMALL_VOCAB = 8
ROWS = 4000
NEW = 4  # t1 from the prefill; t2, t3 drafted (2 heads) and t4 the bonus or a later step
ALPHA = 1e-3  # significance level of each chi-square test
PROMPT = torch.tensor([3, 1, 4])


@pytest.fixture(scope="module")
def small_lm() -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    return Qwen2ForCausalLM(tiny_qwen2_config(SMALL_VOCAB, num_hidden_layers=1, initializer_range=INIT)).eval()


def _exact_joint(lm: Qwen2ForCausalLM, prompt: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """P(t1, t2, t3, t4) (V, V, V, V) under plain sampling with `params`: one forward over all V^3 prefixes."""
    V = SMALL_VOCAB
    grid = torch.cartesian_prod(*[torch.arange(V)] * (NEW - 1))  # (V^3, 3)
    seqs = torch.cat([prompt.expand(len(grid), -1), grid], dim=1)  # (V^3, P + 3)
    with torch.no_grad():
        logits = lm(seqs).logits[:, prompt.numel() - 1 :]  # (V^3, 4, V): next-token logits of t1..t4
    p = sampling_probs(logits, params).double()  # (V^3, 4, V)
    joint = p[0, 0]  # (V,)
    for i in range(1, NEW):
        # P(t_{i+1} | t_1..t_i): any row whose first i tokens match; the grid is in lexicographic order
        cond = p[:, i].reshape(*[V] * (NEW - 1), V)[(slice(None),) * i + (0,) * (NEW - 1 - i)]  # (V,)*i + (V,)
        joint = joint[..., None] * cond
    return joint


def _chi_square(observed: torch.Tensor, expected_p: torch.Tensor) -> tuple[float, int, float]:
    """Chi-square statistic, degrees of freedom and p-value; cells expecting < 5 pooled into one."""
    observed, expected = observed.flatten().double(), expected_p.flatten() * observed.sum().double()
    impossible = expected == 0  # top-p-truncated: must never be sampled
    assert observed[impossible].sum() == 0
    observed, expected = observed[~impossible], expected[~impossible]
    small = expected < 5
    if small.any():
        observed = torch.cat([observed[~small], observed[small].sum()[None]])
        expected = torch.cat([expected[~small], expected[small].sum()[None]])
    stat = float(((observed - expected) ** 2 / expected).sum())
    df = len(expected) - 1
    return stat, df, float(torch.special.gammaincc(torch.tensor(df / 2.0), torch.tensor(stat / 2.0)))


def _pair_counts(responses: torch.Tensor, i: int) -> torch.Tensor:
    """Counts (V, V) of (t_{i+1}, t_{i+2}) over rows of responses (N, NEW)."""
    flat = responses[:, i] * SMALL_VOCAB + responses[:, i + 1]
    return torch.bincount(flat, minlength=SMALL_VOCAB**2).reshape(SMALL_VOCAB, SMALL_VOCAB)


@pytest.fixture(scope="module")
def small_heads(small_lm) -> dict[str, MedusaHeads]:
    """Two draft heads unlike the model, so both verification outcomes are frequent: random ones
    (acceptance ~0.1-0.3), and ones fitted (100 Adam steps) to 2000 sampled continuations, which can
    only learn the marginals over the tokens they do not see (acceptance ~0.45, the bonus often)."""
    sampled = generate(small_lm, [PROMPT] * 2000, SamplingParams(max_new_tokens=NEW), torch.Generator().manual_seed(5))
    seqs = torch.stack([torch.cat([PROMPT, r]) for r in sampled.response_ids])  # (N, L)
    with torch.no_grad():
        hidden = small_lm.get_decoder()(seqs).last_hidden_state  # (N, L, H)
    length = seqs.shape[1]
    positions = range(PROMPT.numel() - 1, length - 2)
    hidden_t = torch.cat([hidden[:, t] for t in positions])  # (M, H)
    targets = torch.cat(
        [torch.stack([seqs[:, t + 2 + k] if t + 2 + k < length else torch.full_like(seqs[:, 0], -100)
                      for k in range(2)])
         for t in positions], dim=1,
    )  # fmt: skip  # (2, M)
    fitted = _fit(MedusaHeads.from_policy(small_lm, 2), hidden_t, targets, steps=100)
    return {"random": _random_heads(64, SMALL_VOCAB, 2, seed=7, std=0.05), "fitted": fitted}


@pytest.mark.parametrize("kind", ["random", "fitted"])
@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.7, 0.95)])
def test_sampled_distribution_is_the_backbones(small_lm, small_heads, kind, temperature, top_p):
    """Pairs (t1, t2), (t2, t3), (t3, t4) of 4000 rows against the exact marginals of plain
    sampling: each chi-square test at level ALPHA (cells expecting < 5 pooled). Fixed seeds."""
    params = SamplingParams(temperature=temperature, top_p=top_p, max_new_tokens=NEW)
    gen, stats = generate_speculative(
        small_lm, small_heads[kind], [PROMPT] * ROWS, params, torch.Generator().manual_seed(11)
    )
    assert 0.05 < stats.acceptance_rate < 0.8  # replacements and accepted drafts both frequent
    responses, joint = torch.stack(gen.response_ids), _exact_joint(small_lm, PROMPT, params)
    assert top_p == 1 or bool((joint.sum((1, 2, 3)) == 0).any())  # top-p does cut tokens here
    marginals = [joint.sum((2, 3)), joint.sum((0, 3)), joint.sum((0, 1))]
    for i, exact in enumerate(marginals):
        stat, df, p_value = _chi_square(_pair_counts(responses, i), exact)
        assert p_value > ALPHA, f"pair (t{i + 1}, t{i + 2}): chi2={stat:.1f}, df={df}, p={p_value:.2e}"


def _accept_every_draft(logits, drafts, q, params, generator):
    n = torch.full((drafts.shape[0],), drafts.shape[1], dtype=torch.long)
    return n, torch.multinomial(sampling_probs(logits[:, -1], params), 1, generator=generator).squeeze(-1)


def _replace_from_p(logits, drafts, q, params, generator, exact_verify=speculative._verify):
    """The classic slip: the replacement drawn from p instead of normalize(max(0, p - q))."""
    n, _ = exact_verify(logits, drafts, q, params, generator)
    p = sampling_probs(logits, params)[torch.arange(len(n)), n]  # (B, V)
    return n, torch.multinomial(p, 1, generator=generator).squeeze(-1)


@pytest.mark.parametrize("lossy_verify", [_accept_every_draft, _replace_from_p])
def test_chi_square_detects_a_lossy_sampler(small_lm, small_heads, monkeypatch, lossy_verify):
    """The same test (the pair (t2, t3), random heads) rejects two wrong verification rules."""
    monkeypatch.setattr(speculative, "_verify", lossy_verify)
    params = SamplingParams(temperature=1.0, max_new_tokens=NEW)
    gen, _ = generate_speculative(
        small_lm, small_heads["random"], [PROMPT] * ROWS, params, torch.Generator().manual_seed(11)
    )
    joint = _exact_joint(small_lm, PROMPT, params)
    _, _, p_value = _chi_square(_pair_counts(torch.stack(gen.response_ids), 1), joint.sum((0, 3)))
    assert p_value < ALPHA
