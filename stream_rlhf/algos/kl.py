"""KL penalty pieces: per-token estimators of KL(pi || ref) and the controllers of its coefficient.

The estimators take log-probs of tokens sampled from pi (Schulman, "Approximating KL Divergence"):
k1 is unbiased but high-variance and can be negative, k2 is low-variance and biased, k3 is unbiased,
low-variance and never negative.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

MAX_LOG_RATIO = 20.0  # log-ratios are clamped to [-20, 20] before exp


def kl_estimate(logp: Tensor, ref_logp: Tensor, kind: Literal["k1", "k2", "k3"]) -> Tensor:
    """Per-token estimate of KL(pi || ref). logp, ref_logp: (B, T) log-probs of the sampled tokens
    under pi and ref; returns (B, T).

    k1 = logp - ref_logp; k2 = 0.5 * (logp - ref_logp)^2; k3 = exp(d) - d - 1 with
    d = ref_logp - logp clamped to [-20, 20].
    """
    if kind == "k1":
        return logp - ref_logp
    if kind == "k2":
        return 0.5 * (logp - ref_logp) ** 2
    if kind == "k3":
        log_ratio = (ref_logp - logp).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
        return torch.exp(log_ratio) - log_ratio - 1
    raise ValueError(f"kl kind={kind!r}: must be one of 'k1', 'k2', 'k3'")


class FixedKLController:
    """A KL coefficient that never changes."""

    def __init__(self, coef: float) -> None:
        self.coef = coef

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op: the coefficient is fixed."""


class AdaptiveKLController:
    """The adaptive KL coefficient of Ziegler et al. 2019 ("Fine-Tuning Language Models from Human
    Preferences"): steer the observed KL toward `target`, moving the coefficient by at most 20% of
    `n_steps / horizon` per update."""

    def __init__(self, init_coef: float, target: float, horizon: int) -> None:
        if target <= 0:
            raise ValueError(f"target={target}: must be > 0")
        if horizon < 1:
            raise ValueError(f"horizon={horizon}: must be >= 1")
        self.coef = init_coef
        self.target = target
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        """coef *= 1 + clip(current_kl / target - 1, -0.2, 0.2) * n_steps / horizon, where n_steps
        is how many samples (or steps, in the caller's unit of `horizon`) the KL was measured over."""
        proportional_error = min(max(current_kl / self.target - 1, -0.2), 0.2)
        self.coef *= 1 + proportional_error * n_steps / self.horizon
