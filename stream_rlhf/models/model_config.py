"""Config of the job's model (`model`: a checkpoint folder or the embedded tiny model and its warm
start) and of the vision-language side (`vision`: the vision_prefetch stage), beside the code that
builds them (`checkpoint.py`, `warm_start.py`, `vision_language.py`)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Annotated, Literal

from msgspec import Meta

from stream_rlhf.config import ConfigError, check_fields


@dataclass(frozen=True)
class TinyVisionConfig:
    """The vision tower of a tiny Qwen2-VL- or Qwen3-VL-architecture model (a ViT over patch_size
    pixel patches; every spatial_merge_size x spatial_merge_size patches become one image token of
    the LM). A Qwen3-VL tower also hands the language model deepstack features from each of its
    blocks but the last (at most 3; `tiny_architectures.py`)."""

    depth: Annotated[int, Meta(ge=1)] = 2
    """Transformer blocks of the vision tower."""
    embed_dim: Annotated[int, Meta(ge=1)] = 64
    """Width of the vision tower's hidden states; num_heads must divide it."""
    num_heads: Annotated[int, Meta(ge=1)] = 2
    """Attention heads per vision block."""
    mlp_ratio: Annotated[int, Meta(ge=1)] = 2
    """The vision MLP's hidden width as a multiple of embed_dim."""
    patch_size: Annotated[int, Meta(ge=1)] = 8
    """Side in pixels of the square patches the tower embeds; image sides are rounded to multiples of
    patch_size * spatial_merge_size."""
    temporal_patch_size: Annotated[int, Meta(ge=1)] = 2
    """Qwen2-VL encodes an image as two identical frames (a video of length temporal_patch_size)."""
    spatial_merge_size: Annotated[int, Meta(ge=1)] = 2
    """Each square of spatial_merge_size x spatial_merge_size patches is merged into one image token
    of the language model."""

    def __post_init__(self) -> None:
        check_fields(self)
        if self.embed_dim % self.num_heads:
            raise ConfigError(f"num_heads={self.num_heads}: must divide embed_dim={self.embed_dim}")


@dataclass(frozen=True)
class TinyModelConfig:
    """A random-initialised Qwen2- or Qwen3-architecture model (vocabulary from the project's
    tokenizer); with `vision` set, its vision-language member (Qwen2-VL, Qwen3-VL)."""

    architecture: Literal["qwen2", "qwen3"] = "qwen2"
    """The Hugging Face architecture: qwen2 (Qwen2, or Qwen2-VL with `vision`) or qwen3 (Qwen3: no
    QKV bias, RMSNorm on each head's queries and keys; Qwen3-VL with `vision`: deepstack features
    added to the first decoder layers). See docs/models.md for the backends that run each."""
    hidden_size: Annotated[int, Meta(ge=1)] = 128
    """Width of the decoder's hidden states (the embedding size)."""
    intermediate_size: Annotated[int, Meta(ge=1)] = 384
    """Hidden width of each decoder layer's MLP."""
    num_hidden_layers: Annotated[int, Meta(ge=1)] = 2
    """Decoder layers."""
    num_attention_heads: Annotated[int, Meta(ge=1)] = 4
    """Query heads per attention layer."""
    num_key_value_heads: Annotated[int, Meta(ge=1)] = 2
    """Key/value heads per attention layer (grouped-query attention); must divide num_attention_heads."""
    head_dim: Annotated[int, Meta(ge=32)] = 32
    """Width of each attention head; vLLM serves only head_dim >= 32."""
    max_position_embeddings: Annotated[int, Meta(ge=1)] = 64
    """The longest sequence (prompt + response tokens) the model takes."""
    vision: TinyVisionConfig | None = None
    """The vision tower; None: a text-only model."""

    def __post_init__(self) -> None:
        check_fields(self)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_key_value_heads={self.num_key_value_heads}: must divide "
                f"num_attention_heads={self.num_attention_heads}"
            )


@dataclass(frozen=True)
class WarmStartConfig:
    """Short SFT on the task's train split so RL starts from a policy that sometimes succeeds."""

    steps: Annotated[int, Meta(ge=0)] = 400
    """SFT optimizer steps on the embedded tiny model before RL; 0: RL starts from the random
    initialisation."""
    batch_size: Annotated[int, Meta(ge=1)] = 64
    """Prompts with their reference answers per SFT step."""
    lr: Annotated[float, Meta(gt=0)] = 1e-3
    """AdamW's learning rate of the SFT."""
    cache_dir: str = "runs/.cache"
    """Finished warm starts are kept here, keyed by a hash of model, task and these settings."""

    def __post_init__(self) -> None:
        check_fields(self)


@dataclass(frozen=True)
class ModelConfig:
    """The policy model: a checkpoint folder, or the embedded tiny model warm-started here."""

    path: str | None = None
    """A Hugging Face checkpoint folder (config, weights, tokenizer). None: the embedded tiny model."""
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)
    """The embedded tiny model's sizes (`model.tiny`), read when `path` is None."""
    warm_start: WarmStartConfig = field(default_factory=WarmStartConfig)
    """The SFT warm start of the embedded tiny model (`model.warm_start`), read when `path` is None."""
    seed: int = 0
    """Seed of the tiny model's random initialisation (and part of the warm start's cache key)."""

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
    prefetch_depth: Annotated[int, Meta(ge=1)] = 2
    """Mini-batches of features the vision stage may hold ready at the broker beyond what rollout
    has taken (rollout's runner itself takes up to 2 into its input queue)."""
    instances: Annotated[int, Meta(ge=1)] = 1
    """Data-parallel instances of the vision stage (independent of the language model's)."""

    def __post_init__(self) -> None:
        check_fields(self)
