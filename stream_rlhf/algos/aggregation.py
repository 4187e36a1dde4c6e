"""How the actor's per-token loss terms become one number (`algorithm.loss_aggregation`), as
weights on the samples of an optimizer step.

    token_mean      mean over every policy token of the step: each token counts the same, so a long
                    answer weighs more (DAPO's choice; the default)
    sequence_mean   mean over each sample's tokens, then over the samples: each sample counts the
                    same (the GRPO paper's)
    token_sum       each sample's token sum over a fixed budget, then the mean over the samples:
                    no division by the answer's own length (Dr. GRPO's)

Every trainer takes a token mean (each rank's share weighted by its tokens, `train_engine.py`), so
the other two are given as one weight per sample, the same on each of its tokens, that turns the
step's token mean into them: with T the step's policy tokens, S its samples that have any and n_i
sample i's, w_i = T / (S n_i) for sequence_mean and T / (S B) for token_sum (B the budget). They are
computed over the whole step before the ranks take their shares, so any number of ranks (FSDP2,
megatron data parallel) gives the gradient of one.

    weights = row_weights(mask, "sequence_mean", budget)   # (N,) over the step's samples; None: token_mean
    loss = masked_mean(weighted(per_token, weights), mask)
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

LossAggregation = Literal["token_mean", "sequence_mean", "token_sum"]


def row_weights(mask: Tensor, how: LossAggregation, budget: int) -> Tensor | None:
    """(N,) weights of the step's samples for `how` (module docstring); None for token_mean (no
    weights: the token mean itself). mask: (N, R) the step's policy tokens; budget: token_sum's B."""
    if how == "token_mean":
        return None
    tokens = mask.float().sum(dim=-1)  # (N,)
    samples = (tokens > 0).sum().clamp(min=1)
    if how == "sequence_mean":
        return tokens.sum() / (samples * tokens.clamp(min=1))
    if how == "token_sum":
        return torch.full_like(tokens, float(tokens.sum() / (samples * budget)))
    raise ValueError(f"loss aggregation {how!r}: expected token_mean, sequence_mean or token_sum")


def weighted(per_token: Tensor, weights: Tensor | None) -> Tensor:
    """`per_token` (n, R) times each row's weight (n,); unchanged without weights."""
    return per_token if weights is None else per_token * weights[:, None].to(per_token)
