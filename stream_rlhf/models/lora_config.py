"""Config of a trainer's LoRA adapters (`actor.lora`, `critic.lora`), beside the modules it selects
(`lora.py`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated

from msgspec import Meta

from stream_rlhf.config import ConfigError, check_fields

ALL_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
"""The linear layers of a Qwen2/Qwen3 (and their VL members') decoder layer: attention and MLP."""


@dataclass(frozen=True)
class LoRAConfig:
    """Low-rank adapters (LoRA, Hu et al. 2021): each targeted linear layer W of the model's
    decoder layers computes W x + (alpha / rank) B A x, with A (rank, in) and B (out, rank) the only
    weights its trainer trains (and a critic's head; B starts at zero: the first version is the
    checkpoint). The optimizer
    holds state for the adapters alone; rollout, the forwards, checkpoints folders and the final
    policy get the merged weights W + (alpha / rank) B A, so they see a plain model."""

    rank: Annotated[int, Meta(ge=1)] = 8
    """The adapters' rank r: trained parameters per targeted layer are r * (in + out)."""
    alpha: Annotated[float, Meta(gt=0)] = 16.0
    """The adapters' scale is alpha / rank (keep alpha fixed when trying ranks: the update's size
    stays comparable); LoRA usually wants a larger actor.lr than full training."""
    target_modules: list[str] = field(default_factory=lambda: list(ALL_PROJECTIONS))
    """Names of the decoder layers' linear layers that get adapters (the last part of the module
    name); every name must match in the model. The default: all of attention and the MLP."""

    def __post_init__(self) -> None:
        check_fields(self)
        if not self.target_modules:
            raise ConfigError("target_modules=[]: name at least one linear layer (e.g. q_proj, v_proj)")
        if len(set(self.target_modules)) != len(self.target_modules):
            raise ConfigError(f"target_modules={self.target_modules!r}: a name appears twice")
