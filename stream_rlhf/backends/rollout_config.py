"""Config of generation (`rollout`: backend, instances, sampling, Medusa speculative decoding),
beside the rollout backends (`torch_rollout.py`, `vllm_rollout.py`, `speculative.py`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from stream_rlhf.backends.vllm_config import VllmConfig
from stream_rlhf.config import ConfigError


@dataclass(frozen=True)
class MedusaConfig:
    """Medusa heads for lossless speculative rollout, trained beside the actor (companion training).

    Rollout proposes `heads` tokens from the heads and verifies them with one backbone forward;
    the sampled distribution stays exactly the backbone's. The `medusa_train` stage fine-tunes
    the heads on each iteration's experiences with the backbone frozen and publishes them; rollout
    uses heads trained against a backbone at most `max_lag` versions older than its own, and
    decodes plainly otherwise (counted).
    """

    enabled: bool = False
    heads: int = 3
    lr: float = 1e-3
    max_lag: int = 2
    """Policy versions the heads' backbone may trail rollout's before rollout stops using them."""
    companion: bool = True
    """false: the heads stay as the warm start left them (stale heads, for comparison)."""
    epochs: int = 1
    """Passes of the heads' training over each iteration's experiences."""
    warm_start_steps: int = 200
    """Steps training the heads on the warm-started policy's hidden states (embedded tiny model)."""
    probe_every: int = 8
    """Every this many mini-batches rollout decodes one plainly, to compare speeds: speculation
    turns itself off while it is slower than plain decoding, and says so."""

    def __post_init__(self) -> None:
        for name in ("heads", "epochs", "probe_every"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)}: must be >= 1")
        if self.max_lag < 0 or self.warm_start_steps < 0:
            raise ConfigError(f"max_lag={self.max_lag}, warm_start_steps={self.warm_start_steps}: must be >= 0")
        if self.lr <= 0:
            raise ConfigError(f"lr={self.lr}: must be > 0")


@dataclass(frozen=True)
class RolloutConfig:
    backend: Literal["torch", "vllm"] = "torch"
    """`torch`: our KV-cache sampler; `vllm`: a vLLM engine per instance (the `vllm` extra)."""
    instances: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 6
    stop: list[str] | None = None
    """Tokens that end a response (kept in it); None: the tokenizer's end-of-sequence token."""
    medusa: MedusaConfig = field(default_factory=MedusaConfig)
    vllm: VllmConfig = field(default_factory=VllmConfig)

    def __post_init__(self) -> None:
        if self.instances < 1:
            raise ConfigError(f"instances={self.instances}: must be >= 1")
        if self.temperature < 0:
            raise ConfigError(f"temperature={self.temperature}: must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p={self.top_p}: must be in (0, 1]")
        if self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens={self.max_new_tokens}: must be >= 1")
        if self.backend == "vllm" and self.top_p < 1:
            # vLLM reports log-probs of the top-p-truncated distribution; the pipeline's behaviour
            # log-probs are under the full tempered one (what the forwards recompute)
            raise ConfigError(f"top_p={self.top_p}: backend=vllm needs top_p 1 (its log-probs would be "
                              "of the truncated distribution)")
        if self.backend == "vllm" and self.medusa.enabled:
            raise ConfigError("medusa.enabled=true: Medusa speculative rollout is built on backend=torch")
