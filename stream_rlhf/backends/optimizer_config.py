"""The optimizer config of a train engine (`actor`, `critic`), beside the engine
(`backends/torch_engine.py`): AdamW's learning rate and weight decay, gradient clipping, and what
it trains (the whole model, or LoRA adapters: `models/lora.py`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from msgspec import Meta

from stream_rlhf.config import check_fields
from stream_rlhf.models.lora_config import LoRAConfig


@dataclass(frozen=True)
class OptimizerConfig:
    """A train engine's AdamW optimizer, gradient clipping and what it trains."""

    lr: Annotated[float, Meta(gt=0)] = 1e-4
    """AdamW's learning rate."""
    weight_decay: Annotated[float, Meta(ge=0)] = 0.0
    """AdamW's decoupled weight decay."""
    max_grad_norm: Annotated[float, Meta(gt=0)] = 1.0
    """Gradients are clipped to this total norm (over every rank's shard) before each step."""
    micro_batch_tokens: Annotated[int, Meta(ge=1)] | None = None
    """Split each rank's share of an optimizer step into micro-batches of at most this many tokens
    (prompt + response, a prompt its samples share counted once; whole samples, a longer one alone)
    whose gradients accumulate to the one pass's: the step holds one micro-batch's activations.
    The forwards of the same model (actor's: the reference, actor forward and proximal log-probs;
    critic's: its values) pass in runs of this budget too. On megatron the micro-batches are its
    pipeline schedule's (1F1B under pp > 1). None: one pass."""
    gradient_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward pass instead of keeping them
    (activation checkpointing: less memory, about a third more compute; the torch backend, megatron's
    is `placement.stages.<stage>.megatron.recompute`)."""
    lora: LoRAConfig | None = None
    """Train low-rank adapters on the model's decoder layers instead of all its weights (the torch
    backend; a critic's value head still trains whole); None: full training."""

    def __post_init__(self) -> None:
        check_fields(self)
