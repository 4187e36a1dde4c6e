"""The optimizer config of a train engine (`actor`, `critic`), beside the engine
(`backends/torch_engine.py`): AdamW's learning rate and weight decay, and gradient clipping."""

from __future__ import annotations

import math
from dataclasses import dataclass

from stream_rlhf.config import ConfigError


@dataclass(frozen=True)
class OptimizerConfig:
    lr: float = 1e-4
    """AdamW's learning rate."""
    weight_decay: float = 0.0
    """AdamW's decoupled weight decay."""
    max_grad_norm: float = 1.0
    """Gradients are clipped to this total norm (over every rank's shard) before each step."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ConfigError(f"lr={self.lr}: must be finite and > 0")
        if not (math.isfinite(self.weight_decay) and self.weight_decay >= 0):
            raise ConfigError(f"weight_decay={self.weight_decay}: must be finite and >= 0")
        if not (math.isfinite(self.max_grad_norm) and self.max_grad_norm > 0):
            raise ConfigError(f"max_grad_norm={self.max_grad_norm}: must be finite and > 0")
