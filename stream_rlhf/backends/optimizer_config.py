"""The optimizer config of a train engine (`actor`, `critic`), beside the engine
(`backends/torch_engine.py`): AdamW's learning rate and weight decay, and gradient clipping; the
actor's adds LoRA (`actor.lora`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from msgspec import Meta

from stream_rlhf.config import check_fields
from stream_rlhf.models.lora_config import LoRAConfig


@dataclass(frozen=True)
class OptimizerConfig:
    """A train engine's AdamW optimizer and gradient clipping."""

    lr: Annotated[float, Meta(gt=0)] = 1e-4
    """AdamW's learning rate."""
    weight_decay: Annotated[float, Meta(ge=0)] = 0.0
    """AdamW's decoupled weight decay."""
    max_grad_norm: Annotated[float, Meta(gt=0)] = 1.0
    """Gradients are clipped to this total norm (over every rank's shard) before each step."""

    def __post_init__(self) -> None:
        check_fields(self)


@dataclass(frozen=True)
class ActorConfig(OptimizerConfig):
    """The actor's optimizer (as any train engine's) and what it trains: the whole policy, or LoRA
    adapters on it."""

    lora: LoRAConfig | None = None
    """Train low-rank adapters on the policy's decoder layers instead of all its weights
    (`actor.lora`; the torch backend); None: full training."""
