"""Actor and critic losses for PPO-style updates: pure functions returning `(loss, metrics)`.

Every loss is a token mean over `mask` (`masked_mean`); the actor's three (policy, KL, entropy)
take `row_weights`, which make that mean a sequence mean or a budgeted sum
(`algorithm.loss_aggregation`, `aggregation.py`). Every metric is a detached 0-dim tensor
over the valid tokens, on the loss's device: reading a value to the host waits for the device, so
the train engine reads all of a step's metrics at once (`host_metrics`: one read per optimizer step).
Inputs are `(B, T)` per-token tensors. Only `logp`, `values` and `entropy` carry
gradient; old log-probs, behavior log-probs, reference log-probs, advantages and returns are
detached here. Inputs at masked-out positions (padding, an episode's observation tokens) never
reach a loss, a metric or a gradient, even NaN or inf: each function replaces them by 0 before any
arithmetic (`where_valid`), so the gradient there is exactly 0.

Log-probs, three policies: `logp` is the policy being trained; `old_logp` the proximal policy, the
same weights before this update (the actor forward's log-probs), which anchors the PPO clip;
`behavior_logp` the policy that generated the tokens, which with streaming rollout may be some
versions older than `old_logp` (decoupled PPO corrects for the gap with an importance weight).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

import torch
from torch import Tensor

from stream_rlhf.algos.aggregation import weighted
from stream_rlhf.algos.kl import MAX_LOG_RATIO, kl_estimate
from stream_rlhf.algos.masked import masked_mean, where_valid


def policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float,
    clip_high: float,
    behavior_logp: Tensor | None = None,
    is_cap: float | None = None,
    row_weights: Tensor | None = None,
    sequence_ratio: bool = False,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate, optionally decoupled from the behavior policy.

    ratio = exp(logp - old_logp) (log-ratio clamped to [-20, 20]); per token
    -min(ratio * A, clip(ratio, 1 - clip_low, 1 + clip_high) * A). With `sequence_ratio` (GSPO,
    `algorithm.ratio_level`) every token of a sample takes the sample's ratio, exp of the mean of
    its tokens' log-ratios: a sample is clipped as a whole, and its tokens share its gradient. With
    `behavior_logp`, each token is weighted by w = exp(old_logp - behavior_logp), detached,
    truncated to w <= is_cap when `is_cap` is set (truncated importance sampling; per token with
    either ratio). `row_weights` (B,): each sample's weight in the token mean
    (`aggregation.row_weights`; None: 1).

    Metrics: `clipfrac` (fraction of tokens where the clipped term is the one taken, so the token
    gives no gradient), `approx_kl` (k3 estimate of KL(pi_old || pi): mean of ratio - 1 - log ratio,
    of the ratio in use),
    `ratio_max`; with `behavior_logp` also `is_weight_mean` (mean of the applied, truncated weight)
    and `is_truncated_frac` (fraction of tokens whose weight was cut to is_cap).
    """
    logp, old_logp, advantages = (where_valid(x, mask) for x in (logp, old_logp.detach(), advantages.detach()))
    log_ratio = logp - old_logp
    if sequence_ratio:
        log_ratio = masked_mean(log_ratio, mask, dim=-1)[:, None].expand_as(log_ratio)
    log_ratio = log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)
    unclipped = ratio * advantages
    clipped = ratio.clamp(1 - clip_low, 1 + clip_high) * advantages
    per_token = -torch.minimum(unclipped, clipped)

    metrics: dict[str, Tensor] = {}
    if behavior_logp is not None:
        behavior_logp = where_valid(behavior_logp.detach(), mask)
        raw_weight = torch.exp((old_logp - behavior_logp).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))
        weight = raw_weight if is_cap is None else raw_weight.clamp(max=is_cap)
        per_token = per_token * weight
        metrics["is_weight_mean"] = masked_mean(weight, mask).detach()
        metrics["is_truncated_frac"] = (
            torch.zeros((), device=mask.device) if is_cap is None
            else masked_mean((raw_weight > is_cap).float(), mask).detach()
        )

    loss = masked_mean(weighted(per_token, row_weights), mask)
    with torch.no_grad():
        metrics["clipfrac"] = masked_mean((clipped < unclipped).float(), mask)
        metrics["approx_kl"] = masked_mean(ratio - 1 - log_ratio, mask)
        metrics["ratio_max"] = torch.where(mask.bool(), ratio, 0.0).max()
    return loss, metrics


def value_loss(
    values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, clip_eps: float
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped value loss: per token 0.5 * max((v - R)^2, (clip(v, old_v - eps, old_v + eps) - R)^2).

    Metrics: `value_clipfrac` (fraction of tokens where the clipped term is the larger, so the token
    gives no gradient), `value_mse` (mean of the unclipped (v - R)^2).
    """
    values, old_values, returns = (where_valid(x, mask) for x in (values, old_values.detach(), returns.detach()))
    clipped_values = old_values + (values - old_values).clamp(-clip_eps, clip_eps)
    unclipped_error = (values - returns) ** 2
    clipped_error = (clipped_values - returns) ** 2
    loss = 0.5 * masked_mean(torch.maximum(unclipped_error, clipped_error), mask)
    with torch.no_grad():
        metrics = {
            "value_clipfrac": masked_mean((clipped_error > unclipped_error).float(), mask),
            "value_mse": masked_mean(unclipped_error, mask),
        }
    return loss, metrics


def kl_loss(
    logp: Tensor, ref_logp: Tensor, mask: Tensor, kind: Literal["k1", "k2", "k3"], row_weights: Tensor | None = None
) -> tuple[Tensor, dict[str, Tensor]]:
    """KL(pi || ref) penalty as a loss: token mean of `kl_estimate(logp, ref_logp, kind)`, see
    `kl_estimate` for the kinds, each sample weighted by `row_weights` (None: 1). Metrics: `kl`
    (the plain token mean, whatever the weights)."""
    per_token = kl_estimate(where_valid(logp, mask), where_valid(ref_logp.detach(), mask), kind)
    loss = masked_mean(weighted(per_token, row_weights), mask)
    return loss, {"kl": loss.detach() if row_weights is None else masked_mean(per_token.detach(), mask)}


def entropy_loss(entropy: Tensor, mask: Tensor, row_weights: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """Negative token-mean entropy, so that `total = pg + coef * entropy_loss` adds an entropy bonus,
    each sample weighted by `row_weights` (None: 1). entropy: (B, T) per-token entropy of the
    policy. Metrics: `entropy` (the plain mean entropy, whatever the weights)."""
    entropy = where_valid(entropy, mask)
    loss = -masked_mean(weighted(entropy, row_weights), mask)
    return loss, {"entropy": -loss.detach() if row_weights is None else masked_mean(entropy.detach(), mask)}


def host_metrics(metrics: Mapping[str, Tensor | float]) -> dict[str, float]:
    """Every metric as a python float, the tensors among them read to the host in one copy (one
    wait for the device, however many metrics); same values as `.item()` of each."""
    names = [name for name, value in metrics.items() if isinstance(value, Tensor)]
    read = dict(zip(names, torch.stack([metrics[n].detach().reshape(()) for n in names]).tolist())) if names else {}
    return {name: read[name] if name in read else float(value) for name, value in metrics.items()}
