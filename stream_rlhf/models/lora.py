"""LoRA adapters on the decoder layers of a Hugging Face causal LM, and their merge back into
plain weights (what rollout, the forwards and checkpoint folders see).

    targets = add_lora(model, LoRAConfig(rank=8), seed=0)  # the base frozen: only A and B train
    plain = merge_lora(model.state_dict())                 # W + (alpha / rank) B A; no adapter keys
    save_adapter(model.state_dict(), folder / "adapter")   # the adapters alone, as PEFT saves them
    with adapters_off(model): ...                          # the base model: the starting checkpoint

A targeted `nn.Linear` becomes a `LoRALinear` that keeps its `weight` and `bias` under their
names, beside `lora_A` (rank, in), `lora_B` (out, rank) and the scale `lora_scale` (a buffer, so a
saved state merges without its config). `merge_lora` works on any state dict, a gathered one of a
sharded model included, and leaves one without adapter keys as it is.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import Tensor, nn
from torch.nn import functional as F

from stream_rlhf.models.checkpoint import decoder_layers
from stream_rlhf.models.lora_config import LoRAConfig

ADAPTER_KEYS = ("lora_A", "lora_B", "lora_scale")
"""The state-dict entries a `LoRALinear` adds to its linear layer's."""
ADAPTER_FOLDER = "adapter"
"""Where a saved checkpoint folder keeps its adapters alone (`save_adapter`)."""


class LoRALinear(nn.Linear):
    """A linear layer with a low-rank adapter beside its frozen weight: W x + b + scale B A x."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, generator: torch.Generator):
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.bias = base.bias
        a = torch.empty(rank, base.in_features)
        nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=generator)  # as nn.Linear's own init
        self.lora_A = nn.Parameter(a.to(base.weight.device, base.weight.dtype))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, rank, device=base.weight.device,
                                               dtype=base.weight.dtype))  # zero: the model starts unchanged
        self.register_buffer("lora_scale", torch.tensor(alpha / rank))
        self.adapter_on = True
        """False: the frozen layer alone (`adapters_off`)."""

    def forward(self, x: Tensor) -> Tensor:
        base = F.linear(x, self.weight, self.bias)
        if not self.adapter_on:
            return base
        return base + F.linear(F.linear(x, self.lora_A), self.lora_B) * self.lora_scale


def add_lora(model: nn.Module, cfg: LoRAConfig, seed: int, key: str = "actor.lora") -> list[str]:
    """Freeze `model` but a value model's head (`score`: it starts at zero, so it trains whole) and
    give the linear layers `cfg.target_modules` names inside its decoder layers an adapter each (A
    drawn from `seed`: the same on every rank); returns their module names. A ValueError names the
    targets (`key`.target_modules) that match no linear layer there."""
    model.requires_grad_(False)
    head = getattr(model, "score", None)
    if head is not None:
        head.requires_grad_(True)
    generator = torch.Generator().manual_seed(seed)
    wrapped, found = [], set()
    names = {id(m): name for name, m in model.named_modules()}
    layers = [(names[id(m)], m) for m in decoder_layers(model)]
    for layer_name, layer in layers:
        for name, module in list(layer.named_modules()):
            leaf = name.rpartition(".")[2]
            if leaf in cfg.target_modules and type(module) is nn.Linear:
                parent = layer.get_submodule(name.rpartition(".")[0]) if "." in name else layer
                setattr(parent, leaf, LoRALinear(module, cfg.rank, cfg.alpha, generator))
                wrapped.append(f"{layer_name}.{name}")
                found.add(leaf)
    missing = [t for t in cfg.target_modules if t not in found]
    if missing:
        present = sorted({n.rpartition(".")[2] for _, layer in layers[:1] for n, m in layer.named_modules()
                          if isinstance(m, nn.Linear)})
        raise ValueError(f"{key}.target_modules: {missing} name no linear layer of the model's decoder layers "
                         f"(they have {present})")
    return wrapped


@contextmanager
def adapters_off(model: nn.Module) -> Iterator[None]:
    """`model` without its adapters inside the block: its frozen weights alone, which under LoRA
    are the starting checkpoint's (the reference policy's)."""
    layers = [m for m in model.modules() if isinstance(m, LoRALinear)]
    for layer in layers:
        layer.adapter_on = False
    try:
        yield
    finally:
        for layer in layers:
            layer.adapter_on = True


def has_lora(model: nn.Module) -> bool:
    return any(isinstance(m, LoRALinear) for m in model.modules())


def merged_names(model: nn.Module) -> list[str]:
    """The weights training changes, in Hugging Face names and model order: each adapted layer's
    (`<module>.weight`, merged) and the parameters that train whole (a value head)."""
    adapted = {f"{name}.weight" for name, m in model.named_modules() if isinstance(m, LoRALinear)}
    return [name for name, p in model.named_parameters()
            if name in adapted or (p.requires_grad and name.rpartition(".")[2] not in ADAPTER_KEYS)]


def _adapted(state: dict[str, Tensor]) -> list[str]:
    """The module names of the adapted layers of a state dict (those with a `lora_A`)."""
    return [key[: -len(".lora_A")] for key in state if key.endswith(".lora_A")]


def merge_lora(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """`state` with each adapted weight replaced by W + scale B A (a new tensor, in W's dtype, on
    W's device) and the adapter entries left out; a state without adapters comes back as it is."""
    prefixes = _adapted(state)
    if not prefixes:
        return state
    out = {key: value for key, value in state.items() if key.rpartition(".")[2] not in ADAPTER_KEYS}
    with torch.no_grad():
        for prefix in prefixes:
            weight = state[f"{prefix}.weight"]
            delta = state[f"{prefix}.lora_B"].float() @ state[f"{prefix}.lora_A"].float()  # (out, in)
            out[f"{prefix}.weight"] = (weight.float() + delta * state[f"{prefix}.lora_scale"].float()).to(weight.dtype)
    return out


def save_adapter(state: dict[str, Tensor], folder: Path) -> None:
    """The adapters of `state` (a LoRA model's own state, adapter keys included) as a PEFT LoRA
    adapter folder (`adapter_config.json`, `adapter_model.safetensors`): `PeftModel.from_pretrained(
    base, folder)` on the starting checkpoint gives the trained policy (peft's names:
    `base_model.model.<module>.lora_A.weight`)."""
    prefixes = _adapted(state)
    if not prefixes:
        raise ValueError("save_adapter: the state holds no LoRA adapters")
    rank = state[f"{prefixes[0]}.lora_A"].shape[0]
    alpha = float(state[f"{prefixes[0]}.lora_scale"]) * rank
    tensors = {f"base_model.model.{prefix}.lora_{ab}.weight": state[f"{prefix}.lora_{ab}"].detach().cpu().contiguous()
               for prefix in prefixes for ab in "AB"}
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, folder / "adapter_model.safetensors")
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha, "lora_dropout": 0.0,
              "target_modules": sorted({p.rpartition(".")[2] for p in prefixes}), "bias": "none",
              "fan_in_fan_out": False, "inference_mode": True, "base_model_name_or_path": None}
    (folder / "adapter_config.json").write_text(json.dumps(config, indent=1))
