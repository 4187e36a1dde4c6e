"""Config of generation (`rollout`: backend, instances, sampling, Medusa speculative decoding),
beside the rollout backends (`torch_rollout.py`, `vllm_rollout.py`, `speculative.py`)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Annotated, Literal

from msgspec import Meta

from stream_rlhf.backends.vllm_config import VllmConfig
from stream_rlhf.config import ConfigError, check_fields
from stream_rlhf.data.generation_config import GENERATION_CONFIG, read_generation_config


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
    """true: rollout speculates with Medusa heads and the `medusa_train` stage trains them (torch
    backend, text models only)."""
    heads: Annotated[int, Meta(ge=1)] = 3
    """Medusa heads: beside the LM head's next token, head k (0-based) proposes the token k + 2
    places ahead, so one verifying forward can accept up to heads + 1 tokens."""
    lr: Annotated[float, Meta(gt=0)] = 1e-3
    """AdamW's learning rate of the heads' training (the warm start's and `medusa_train`'s)."""
    max_lag: Annotated[int, Meta(ge=0)] = 2
    """Policy versions the heads' backbone may trail rollout's before rollout stops using them."""
    companion: bool = True
    """false: the heads stay as the warm start left them (stale heads, for comparison)."""
    epochs: Annotated[int, Meta(ge=1)] = 1
    """Passes of the heads' training over each iteration's experiences."""
    warm_start_steps: Annotated[int, Meta(ge=0)] = 200
    """Steps training the heads on the warm-started policy's hidden states (embedded tiny model)."""
    probe_every: Annotated[int, Meta(ge=1)] = 8
    """Every this many mini-batches rollout decodes one plainly, to compare speeds: speculation
    turns itself off while it is slower than plain decoding, and says so."""

    def __post_init__(self) -> None:
        check_fields(self)


@dataclass(frozen=True)
class RolloutConfig:
    """Generation: which engine samples the responses, how many instances, and how it samples."""

    backend: Literal["torch", "vllm"] = "torch"
    """`torch`: our KV-cache sampler; `vllm`: a vLLM engine per instance (the `vllm` extra)."""
    instances: Annotated[int, Meta(ge=1)] = 1
    """Rollout instances (data parallel): each takes whole mini-batches from the broker, the
    least-loaded first, and holds a copy of the policy."""
    temperature: Annotated[float, Meta(ge=0)] | None = None
    """Sampling temperature: tokens are drawn from softmax(logits / temperature); 0: greedy. The
    trainers compute log-probs at this same temperature, so it is part of the objective. None:
    `model.path`'s generation_config.json's, else 1 (set when the job config is built)."""
    top_p: Annotated[float, Meta(gt=0, le=1)] | None = None
    """Nucleus sampling: draw from the smallest set of tokens whose probability reaches top_p; 1:
    the whole vocabulary (what backend vllm needs). None: `model.path`'s generation_config.json's,
    else 1 (set when the job config is built)."""
    max_new_tokens: Annotated[int, Meta(ge=1)] = 6
    """The most tokens a response may have; a response that reaches it without a stop token is cut
    there."""
    stop: list[str] | None = None
    """Tokens that end a response (kept in it); None: the tokenizer's end-of-sequence token, the
    chat template's end-of-turn token and the eos ids of the model's generation_config.json."""
    decode: Literal["auto", "eager", "static", "graphs"] = "auto"
    """How the torch sampler (plain, Medusa and eval) runs its decode steps: `eager` over a batch
    that shrinks as rows finish; `static` over KV caches preallocated per batch and length bucket;
    `graphs` the same with each step a CUDA graph captured per bucket and replayed (CUDA only);
    `auto`: graphs on CUDA, eager on the CPU (faster there). Same tokens in every mode."""
    medusa: MedusaConfig = field(default_factory=MedusaConfig)
    """Medusa speculative decoding (`rollout.medusa`); off by default."""
    vllm: VllmConfig = field(default_factory=VllmConfig)
    """The vLLM engine's settings (`rollout.vllm`), read with backend vllm."""

    def __post_init__(self) -> None:
        check_fields(self)
        if self.backend == "vllm" and self.top_p is not None and self.top_p < 1:
            # vLLM reports log-probs of the top-p-truncated distribution; the pipeline's behaviour
            # log-probs are under the full tempered one (what the forwards recompute)
            raise ConfigError(f"top_p={self.top_p}: backend=vllm needs top_p 1 (its log-probs would be "
                              "of the truncated distribution)")
        if self.backend == "vllm" and self.medusa.enabled:
            raise ConfigError("medusa.enabled=true: Medusa speculative rollout is built on backend=torch")

    def with_generation_defaults(self, model_folder: str | None) -> RolloutConfig:
        """This config with `temperature` and `top_p` that are None taken from `model_folder`'s
        generation_config.json, else 1 (top_k, repetition_penalty and the like are not read)."""
        settings = read_generation_config(model_folder)
        chosen = {name: settings.get(name, 1.0) if getattr(self, name) is None else getattr(self, name)
                  for name in ("temperature", "top_p")}
        try:
            return replace(self, **chosen)
        except ConfigError as error:
            raise ConfigError(f"{error} (unset, it is {model_folder}/{GENERATION_CONFIG}'s: set it in the config)") \
                from None
