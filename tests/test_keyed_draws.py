"""Token draws keyed by (seed, index) (`backends/keyed_draws.py`) and turn seeds (`seeding.TurnSeeds`):
SplitMix64's reference outputs, rows independent of their company, and inverse-CDF sampling that
follows the distribution."""

from __future__ import annotations

import math

import numpy as np
import torch

from stream_rlhf.backends.keyed_draws import inverse_cdf, keyed_uniforms
from stream_rlhf.backends.torch_rollout import SamplingParams, sample_tokens, sampling_probs
from stream_rlhf.seeding import TurnSeeds

MASK64 = (1 << 64) - 1


def splitmix64(seed: int, index: int) -> int:
    """The index-th output of SplitMix64 seeded `seed`, in Python's unbounded integers."""
    z = (seed + (index + 1) * 0x9E3779B97F4A7C15) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def test_the_numbers_are_splitmix64s_outputs():
    assert splitmix64(0, 0) == 0xE220A8397B1DCDAF  # the published first output for seed 0
    seeds, indices = [0, 1, 2**62 - 1, 2**62 - 1, 123456789], [0, 0, 0, 41, 7]
    expected = [(splitmix64(s, i) >> 11) * 2.0**-53 for s, i in zip(seeds, indices)]
    assert keyed_uniforms(seeds, indices).tolist() == expected


def test_a_rows_number_depends_on_its_seed_and_index_only():
    g = np.random.default_rng(0)
    seeds, indices = g.integers(0, 2**62, 64).tolist(), g.integers(0, 100, 64).tolist()
    batch = keyed_uniforms(seeds, indices)
    alone = [keyed_uniforms([s], [i])[0] for s, i in zip(seeds, indices)]
    order = g.permutation(64)
    shuffled = keyed_uniforms([seeds[r] for r in order], [indices[r] for r in order])
    assert batch.tolist() == alone and shuffled.tolist() == batch[order].tolist()
    assert len(set(batch.tolist())) == 64 and 0 <= batch.min() and batch.max() < 1


def test_inverse_cdf_follows_the_distribution_and_never_draws_a_zero():
    probs = torch.tensor([0.05, 0.0, 0.5, 0.25, 0.0, 0.2]) * 3  # unnormalised: the row's mass scales
    n = 40_000
    tokens = inverse_cdf(probs.expand(n, -1), torch.from_numpy(keyed_uniforms([7] * n, range(n))))
    counts = torch.bincount(tokens, minlength=6).double()
    assert counts[1] == counts[4] == 0
    expected = probs.double() / probs.sum() * n
    chi2 = float(((counts - expected) ** 2 / expected.clamp(min=1))[expected > 0].sum())
    assert chi2 < 16.3  # 3 degrees of freedom: p = 0.001


def test_the_edges_of_the_unit_interval_draw_tokens_of_positive_probability():
    probs = torch.tensor([[0.0, 0.3, 0.7, 0.0, 0.0]] * 4) * 1.7
    uniforms = torch.tensor([0.0, 0.3 - 1e-6, 0.3 + 1e-6, 1.0 - 2.0**-53], dtype=torch.float64)
    assert inverse_cdf(probs, uniforms).tolist() == [1, 1, 2, 2]
    assert inverse_cdf(probs[:1], torch.ones(1, dtype=torch.float64)).tolist() == [2]  # a 1 rounded up: the last


def test_sample_tokens_with_uniforms_draws_the_top_p_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, 0.0]])
    params = SamplingParams(temperature=0.7, top_p=0.8)
    probs = sampling_probs(logits, params)[0]
    n = 20_000
    tokens = sample_tokens(logits.expand(n, -1), params, None, torch.from_numpy(keyed_uniforms([3] * n, range(n))))
    frequencies = torch.bincount(tokens, minlength=5).double() / n
    assert frequencies[probs == 0].sum() == 0
    torch.testing.assert_close(frequencies, probs.double(), atol=4 * math.sqrt(0.25 / n), rtol=0)


def test_turn_seeds_name_episodes_and_count_their_turns():
    seeds = TurnSeeds((0, "rollout", 2, 1))
    first = [seeds.next(0, ("a",)), seeds.next(0, ("a",)), seeds.next(1, ())]
    again = TurnSeeds((0, "rollout", 2, 1))
    assert again.next(5, ()) != first[2]  # an unnamed episode is named by its slot
    assert [again.next(3, ("a",)), again.next(3, ("a",)), again.next(1, ())] == first  # any slot, any order
    again.release(3)  # a named episode's count is dropped with it
    assert again.next(3, ("a",)) == first[0]
    assert len(set(first)) == 3 and all(0 <= s < 2**62 for s in first)
