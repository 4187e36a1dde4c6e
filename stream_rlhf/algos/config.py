"""Config of the RL algorithm (`algorithm`: advantage estimator, PPO clipping, epochs, and its
`kl` penalty), beside the math it selects (`advantages.py`, `losses.py`, `kl.py`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from stream_rlhf.algos.advantages import ADVANTAGE_ESTIMATORS, NEEDS_CRITIC
from stream_rlhf.config import ConfigError

Estimator = Literal["gae", "grpo", "rloo", "reinforce_pp"]


@dataclass(frozen=True)
class KLConfig:
    kind: Literal["k1", "k2", "k3"] = "k1"
    placement: Literal["reward", "loss"] = "reward"
    """`reward`: -coef * KL per token is added to the reward; `loss`: coef * KL is added to the loss."""
    coef: float = 0.01
    target: float | None = None
    """Set to make the coefficient adaptive (Ziegler et al.): it moves to keep KL near target."""
    horizon: int = 10_000

    def __post_init__(self) -> None:
        if self.coef < 0:
            raise ConfigError(f"coef={self.coef}: must be >= 0")
        if self.target is not None and self.target <= 0:
            raise ConfigError(f"target={self.target}: must be > 0")
        if self.horizon < 1:
            raise ConfigError(f"horizon={self.horizon}: must be >= 1")


@dataclass(frozen=True)
class AlgorithmConfig:
    advantage: Estimator = "gae"
    gamma: float = 1.0
    lam: float = 0.95
    clip_low: float = 0.2
    clip_high: float = 0.2
    value_clip: float = 0.2
    is_cap: float = 2.0
    """Truncation of the behaviour importance weight (decoupled PPO, overlap_depth >= 1)."""
    entropy_coef: float = 0.0
    whiten_advantages: bool = True
    """Whiten over the whole rollout batch (every mini-batch of the iteration)."""
    ppo_epochs: int = 2
    train_minibatches: int = 2
    """Optimizer steps per epoch: the iteration's samples are split into this many."""
    kl: KLConfig = field(default_factory=KLConfig)

    def __post_init__(self) -> None:
        if self.advantage not in ADVANTAGE_ESTIMATORS:
            raise ConfigError(f"advantage={self.advantage!r}: unknown")
        if not 0 <= self.gamma <= 1 or not 0 <= self.lam <= 1:
            raise ConfigError(f"gamma={self.gamma}, lam={self.lam}: must be in [0, 1]")
        if self.ppo_epochs < 1 or self.train_minibatches < 1:
            raise ConfigError(f"ppo_epochs={self.ppo_epochs}, train_minibatches={self.train_minibatches}: must be >= 1")
        if self.is_cap < 1:
            raise ConfigError(f"is_cap={self.is_cap}: must be >= 1")
        for name in ("clip_low", "clip_high", "value_clip", "entropy_coef"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name}={getattr(self, name)}: must be >= 0")
        if self.clip_low >= 1:
            raise ConfigError(f"clip_low={self.clip_low}: must be < 1 (the ratio's lower bound is 1 - clip_low)")

    @property
    def uses_critic(self) -> bool:
        return self.advantage in NEEDS_CRITIC
