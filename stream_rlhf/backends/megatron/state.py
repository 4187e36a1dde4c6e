"""Moving whole Hugging Face state dicts into and out of a megatron model sharded by tp and pp.

    load_hf_state(model, hf_state, layout)    # each rank copies in its shard
    full = export_hf_state(model, layout)     # every rank: full HF tensors, on the CPU

Export is a collective: tensor-parallel shards are all-gathered within each tp group, and each
pipeline stage's tensors are broadcast over the pp group, so every rank ends with every tensor.
The receivers size their buffers from `Layout.hf_shapes` (the HF model's shapes, kept on meta).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from torch import Tensor, nn

from stream_rlhf.backends.megatron.model import Parallel
from stream_rlhf.backends.megatron.weights import Architecture, Dims, Entry, stage_entries, to_hf, to_megatron


@dataclass(frozen=True)
class Layout:
    """How one engine's model is cut: the architecture, its sizes and this rank's place."""

    arch: Architecture
    dims: Dims
    layers: int
    tied: bool
    critic: bool
    parallel: Parallel
    hf_shapes: dict[str, tuple[int, ...]]
    hf_dtypes: dict[str, torch.dtype]

    def entries(self, pp_rank: int) -> list[Entry]:
        return stage_entries(self.arch, self.layers, self.tied, pp_rank, self.parallel.config.pp, self.critic)


def load_hf_state(model: nn.Module, hf_state: dict[str, Tensor], layout: Layout) -> None:
    params = dict(model.named_parameters())
    entries = layout.entries(layout.parallel.pp_rank)
    missing = sorted(set(params) - {e.megatron for e in entries})
    if missing:
        raise ValueError(f"megatron {layout.arch.name}: no HF weight maps to {', '.join(missing)}")
    with torch.no_grad():
        for entry in entries:
            absent = [name for name in entry.hf if name not in hf_state]
            if absent:
                raise ValueError(f"megatron {layout.arch.name}: the checkpoint has no {', '.join(absent)}")
            shard = to_megatron(entry, hf_state, layout.dims, layout.parallel.config.tp, layout.parallel.tp_rank)
            target = params[entry.megatron]
            if shard.shape != target.shape:
                raise ValueError(f"megatron {entry.megatron}: shape {tuple(target.shape)}, mapped from "
                                 f"{', '.join(entry.hf)} as {tuple(shard.shape)}")
            target.copy_(shard)


def export_hf_state(model: nn.Module, layout: Layout) -> dict[str, Tensor]:
    """Every HF tensor, full, on the CPU, on every rank (a tied LM head is the embedding tensor)."""
    params = dict(model.named_parameters())
    parallel = layout.parallel
    tp_group, pp_group = ps.get_tensor_model_parallel_group(), ps.get_pipeline_model_parallel_group()
    out: dict[str, Tensor] = {}
    for stage in range(parallel.config.pp):
        for entry in layout.entries(stage):
            if all(name in out for name in entry.hf):
                continue  # a tied output layer: the embedding already came from the first stage
            if stage == parallel.pp_rank:
                local = params[entry.megatron].detach().cpu()
                shards = [local]
                if parallel.config.tp > 1:
                    shards = [torch.empty_like(local) for _ in range(parallel.config.tp)]
                    dist.all_gather(shards, local.contiguous(), group=tp_group)
                full = to_hf(entry, shards, layout.dims)
            else:
                full = {name: torch.empty(layout.hf_shapes[name], dtype=torch.float32) for name in entry.hf}
            if parallel.config.pp > 1:
                source = dist.get_global_rank(pp_group, stage)
                for name in entry.hf:
                    full[name] = full[name].contiguous()
                    dist.broadcast(full[name], src=source, group=pp_group)
            out.update(full)
    out = {name: _owning(t.to(layout.hf_dtypes.get(name, t.dtype))) for name, t in out.items()}
    if layout.tied:
        out[layout.arch.lm_head] = out[layout.arch.embed]
    return out


def _owning(tensor: Tensor) -> Tensor:
    """`tensor`, or a copy of it where it is a view into a larger storage: at tp 1 a fused QKV or
    gate/up parameter splits into views of one storage, which safetensors refuses to save."""
    whole = tensor.storage_offset() == 0 and tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
    return tensor if whole and tensor.is_contiguous() else tensor.clone(memory_format=torch.contiguous_format)
