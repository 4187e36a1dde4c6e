"""Hugging Face <-> megatron GPTModel weights: which megatron tensor holds which HF tensors, and how
each is split over tensor-parallel ranks and pipeline stages.

    entries = stage_entries(arch, hf_config, pp_rank, pp, critic=False)   # this stage's tensors
    local = to_megatron(entry, hf_state, dims, tp, tp_rank)               # one rank's shard
    hf = to_hf(entry, [shard of every tp rank], dims)                     # {hf name: full tensor}

Split kinds (megatron's local layer spec, no transformer-engine):
  replicated   norms (Qwen3's per-head q and k norms too), the critic's value head: every tp rank
               holds it whole
  vocab        embedding / output layer: rows padded to `padded_vocab`, split over tp ranks
  row          attention output and MLP down projection: split along the input dimension
  qkv          q, k, v fused per key/value group: [q of the group's heads; k; v] per group, the
               groups split over tp ranks (weights and Qwen2's biases alike)
  gate_up      MLP gate and up fused: each tp rank holds [its gate rows; its up rows]
Layers are numbered locally on each pipeline stage (`decoder.layers.0` is the stage's first).
The architecture files (`arch_qwen2.py`, `arch_qwen3.py`, `arch_llama.py`) say which HF names exist.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

Kind = Literal["replicated", "vocab", "row", "qkv", "gate_up"]


@dataclass(frozen=True)
class Dims:
    """The sizes the splits need."""

    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    padded_vocab: int


@dataclass(frozen=True)
class Entry:
    megatron: str
    hf: tuple[str, ...]
    kind: Kind


@dataclass(frozen=True)
class Architecture:
    """What differs between the HF architectures the engine maps (one instance per arch file)."""

    name: str
    qkv_bias: bool
    qk_norm: bool = False
    """An RMSNorm over each head's queries and keys after their projections (Qwen3)."""
    layer_prefix: str = "model.layers"
    embed: str = "model.embed_tokens.weight"
    final_norm: str = "model.norm.weight"
    lm_head: str = "lm_head.weight"


def layer_entries(arch: Architecture, hf_index: int, local_index: int) -> list[Entry]:
    hf = f"{arch.layer_prefix}.{hf_index}"
    mg = f"decoder.layers.{local_index}"
    entries = [
        Entry(f"{mg}.input_layernorm.weight", (f"{hf}.input_layernorm.weight",), "replicated"),
        Entry(f"{mg}.self_attention.linear_qkv.weight", tuple(f"{hf}.self_attn.{p}_proj.weight" for p in "qkv"), "qkv"),
        Entry(f"{mg}.self_attention.linear_proj.weight", (f"{hf}.self_attn.o_proj.weight",), "row"),
        Entry(f"{mg}.pre_mlp_layernorm.weight", (f"{hf}.post_attention_layernorm.weight",), "replicated"),
        Entry(f"{mg}.mlp.linear_fc1.weight", (f"{hf}.mlp.gate_proj.weight", f"{hf}.mlp.up_proj.weight"), "gate_up"),
        Entry(f"{mg}.mlp.linear_fc2.weight", (f"{hf}.mlp.down_proj.weight",), "row"),
    ]
    if arch.qk_norm:
        entries += [Entry(f"{mg}.self_attention.{p}_layernorm.weight", (f"{hf}.self_attn.{p}_norm.weight",),
                          "replicated") for p in "qk"]
    if arch.qkv_bias:
        entries.append(Entry(f"{mg}.self_attention.linear_qkv.bias",
                             tuple(f"{hf}.self_attn.{p}_proj.bias" for p in "qkv"), "qkv"))
    return entries


def stage_entries(arch: Architecture, layers: int, tied: bool, pp_rank: int, pp: int, critic: bool) -> list[Entry]:
    """The tensors pipeline stage `pp_rank` of `pp` holds. A tied output layer exists on the last
    stage only when it is not also the first (megatron keeps the two copies equal)."""
    per_stage = layers // pp
    first, last = pp_rank == 0, pp_rank == pp - 1
    entries = [Entry("embedding.word_embeddings.weight", (arch.embed,), "vocab")] if first else []
    for local in range(per_stage):
        entries += layer_entries(arch, pp_rank * per_stage + local, local)
    if last:
        entries.append(Entry("decoder.final_layernorm.weight", (arch.final_norm,), "replicated"))
        if critic:
            entries += [Entry("value_head.weight", ("score.weight",), "replicated"),
                        Entry("value_head.bias", ("score.bias",), "replicated")]
        elif not tied:
            entries.append(Entry("output_layer.weight", (arch.lm_head,), "vocab"))
        elif not first:
            entries.append(Entry("output_layer.weight", (arch.embed,), "vocab"))
    return entries


def to_megatron(entry: Entry, hf_state: dict[str, Tensor], dims: Dims, tp: int, tp_rank: int) -> Tensor:
    """Tensor-parallel rank `tp_rank`'s shard of `entry`, from full HF tensors."""
    parts = [hf_state[name] for name in entry.hf]
    if entry.kind == "replicated":
        return parts[0].clone()
    if entry.kind == "vocab":
        full = parts[0]
        padded = torch.cat([full, full.new_zeros(dims.padded_vocab - dims.vocab, *full.shape[1:])])
        return padded.chunk(tp)[tp_rank].clone()
    if entry.kind == "row":
        return parts[0].chunk(tp, dim=1)[tp_rank].clone()
    if entry.kind == "gate_up":
        return torch.cat([p.chunk(tp)[tp_rank] for p in parts])
    q, k, v = parts  # (heads * hd, ...), (kv_heads * hd, ...), (kv_heads * hd, ...)
    rest = q.shape[1:]
    groups = dims.kv_heads
    fused = torch.cat([q.reshape(groups, -1, *rest), k.reshape(groups, -1, *rest), v.reshape(groups, -1, *rest)], dim=1)
    return fused.chunk(tp)[tp_rank].reshape(-1, *rest).clone()  # (groups / tp * (q/group + 2) * hd, ...)


def to_hf(entry: Entry, shards: list[Tensor], dims: Dims) -> dict[str, Tensor]:
    """The full HF tensors of `entry` from every tensor-parallel rank's shard, in tp rank order."""
    if entry.kind == "replicated":
        return {entry.hf[0]: shards[0]}
    if entry.kind == "vocab":
        full = torch.cat(shards)
        return {entry.hf[0]: full[: dims.vocab].clone() if len(full) > dims.vocab else full}  # no padding rows kept
    if entry.kind == "row":
        return {entry.hf[0]: torch.cat(shards, dim=1)}
    if entry.kind == "gate_up":
        halves = [s.chunk(2) for s in shards]
        return {entry.hf[0]: torch.cat([h[0] for h in halves]), entry.hf[1]: torch.cat([h[1] for h in halves])}
    rest = shards[0].shape[1:]
    per_group = dims.heads // dims.kv_heads
    fused = torch.cat([s.reshape(-1, (per_group + 2) * dims.head_dim, *rest) for s in shards])  # (groups, ..)
    q, k, v = fused.split([per_group * dims.head_dim, dims.head_dim, dims.head_dim], dim=1)
    return {name: t.reshape(-1, *rest).contiguous() for name, t in zip(entry.hf, (q, k, v))}
