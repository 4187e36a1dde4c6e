"""Config of the job's model (`model`: a checkpoint folder or the embedded tiny model and its warm
start) and of the vision-language side (`vision`: the vision_prefetch stage), beside the code that
builds them (`checkpoint.py`, `warm_start.py`, `vision_language.py`)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from stream_rlhf.config import ConfigError


@dataclass(frozen=True)
class TinyVisionConfig:
    """The vision tower of a tiny Qwen2-VL-architecture model (a ViT over patch_size pixel patches;
    every spatial_merge_size x spatial_merge_size patches become one image token of the LM)."""

    depth: int = 2
    embed_dim: int = 64
    num_heads: int = 2
    mlp_ratio: int = 2
    patch_size: int = 8
    temporal_patch_size: int = 2
    """Qwen2-VL encodes an image as two identical frames (a video of length temporal_patch_size)."""
    spatial_merge_size: int = 2

    def __post_init__(self) -> None:
        for name in ("depth", "embed_dim", "num_heads", "mlp_ratio", "patch_size", "temporal_patch_size",
                     "spatial_merge_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)}: must be >= 1")
        if self.embed_dim % self.num_heads:
            raise ConfigError(f"num_heads={self.num_heads}: must divide embed_dim={self.embed_dim}")


@dataclass(frozen=True)
class TinyModelConfig:
    """A random-initialised Qwen2-architecture model (vocabulary from the project's tokenizer); with
    `vision` set, a Qwen2-VL-architecture vision-language model."""

    hidden_size: int = 128
    intermediate_size: int = 384
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32
    """vLLM serves only head_dim >= 32."""
    max_position_embeddings: int = 64
    vision: TinyVisionConfig | None = None
    """The vision tower; None: a text-only model."""

    def __post_init__(self) -> None:
        for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)}: must be >= 1")
        if self.head_dim < 32:
            raise ConfigError(f"head_dim={self.head_dim}: must be >= 32 (vLLM cannot serve less)")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_key_value_heads={self.num_key_value_heads}: must divide "
                f"num_attention_heads={self.num_attention_heads}"
            )


@dataclass(frozen=True)
class WarmStartConfig:
    """Short SFT on the task's train split so RL starts from a policy that sometimes succeeds."""

    steps: int = 400
    batch_size: int = 64
    lr: float = 1e-3
    cache_dir: str = "runs/.cache"
    """Finished warm starts are kept here, keyed by a hash of model, task and these settings."""

    def __post_init__(self) -> None:
        if self.steps < 0:
            raise ConfigError(f"steps={self.steps}: must be >= 0")
        if self.batch_size < 1:
            raise ConfigError(f"batch_size={self.batch_size}: must be >= 1")
        if not self.lr > 0:
            raise ConfigError(f"lr={self.lr}: must be > 0")


@dataclass(frozen=True)
class ModelConfig:
    path: str | None = None
    """A Hugging Face checkpoint folder (config, weights, tokenizer). None: the embedded tiny model."""
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)
    warm_start: WarmStartConfig = field(default_factory=WarmStartConfig)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.path is not None and not os.path.isfile(os.path.join(self.path, "config.json")):
            raise ConfigError(f"path={self.path!r}: no config.json there (expected a Hugging Face checkpoint folder)")


@dataclass(frozen=True)
class VisionConfig:
    """The vision_prefetch stage of a vision-language model (ignored for text models)."""

    prefetch: bool = True
    """true: the vision_prefetch stage runs the frozen vision tower once per image, ahead of
    rollout, and every other stage reads its features. false: every stage that needs the
    features (rollout, forwards, trainers) runs the vision tower itself (the baseline that
    bench/vision.py compares against)."""
    prefetch_depth: int = 2
    """Mini-batches of features the vision stage may hold ready at the broker beyond what rollout
    has taken (rollout's runner itself takes up to 2 into its input queue)."""
    instances: int = 1
    """Data-parallel instances of the vision stage (independent of the language model's)."""

    def __post_init__(self) -> None:
        if self.prefetch_depth < 1 or self.instances < 1:
            raise ConfigError(f"prefetch_depth={self.prefetch_depth}, instances={self.instances}: must be >= 1")
