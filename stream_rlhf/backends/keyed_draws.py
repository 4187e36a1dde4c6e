"""Token draws keyed by (seed, index): a row's draw depends on its own seed and on how many it has
drawn, never on the rows sampled beside it or on their order.

    uniforms = keyed_uniforms(seeds=[s0, s1], indices=[0, 5])    # (2,) float64 in [0, 1), on the host
    token = inverse_cdf(probs, torch.from_numpy(uniforms).to(probs.device))   # probs (2, V) -> (2,)

A torch.Generator's draws for a batch follow the batch's rows: the same row in other company
draws other numbers. The multi-turn sampler's batch changes at every turn boundary (episodes join
and leave as their tools answer), so each turn there is a stream of its own: turn t of an episode
has a seed (`seeding.TurnSeeds`, the one vLLM's request gets), and its k-th token reads the k-th
number of that stream. The numbers are SplitMix64's outputs (Steele, Lea and Flood, 2014: the
generator Java's SplittableRandom uses), computed from (seed, index) directly in wrapping uint64
arithmetic; a token is the first whose cumulative probability passes the number (inverse-CDF
sampling: exact for any distribution, and a token of probability 0 is never drawn).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

_GAMMA = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


def keyed_uniforms(seeds: Sequence[int], indices: Sequence[int]) -> np.ndarray:
    """(R,) float64 in [0, 1): row r's number is output indices[r] of SplitMix64 seeded seeds[r]
    (53 random bits each). Seeds are taken modulo 2**64; indices must be >= 0."""
    state = np.array(seeds, dtype=np.uint64) + (np.array(indices, dtype=np.uint64) + np.uint64(1)) * _GAMMA
    z = (state ^ (state >> np.uint64(30))) * _MIX1
    z = (z ^ (z >> np.uint64(27))) * _MIX2
    z = z ^ (z >> np.uint64(31))
    return (z >> np.uint64(11)).astype(np.float64) * 2.0**-53


def inverse_cdf(probs: Tensor, uniforms: Tensor) -> Tensor:
    """One token per row of probs (R, V) (each row's mass > 0; it need not sum to 1): the first
    whose cumulative mass exceeds uniforms (R,) x the row's mass. Summed in float64, so a long
    vocabulary's tail keeps its probabilities."""
    cumulative = probs.double().cumsum(-1)  # (R, V)
    total = cumulative[:, -1]  # (R,)
    # below the mass, even where the product rounds up to it: the token found has probability > 0
    target = torch.minimum(uniforms.to(cumulative) * total, torch.nextafter(total, torch.zeros_like(total)))  # (R,)
    return torch.searchsorted(cumulative, target[:, None], right=True).squeeze(-1)  # (R,)
