"""Everything megatron-core 0.16 needs to run on a CPU with gloo, in one place, applied once.

    apply_shims()                 # before megatron builds anything; idempotent
    seed_model_parallel(seed)     # after parallel_state.initialize_model_parallel

The shims (nothing else in the project patches megatron; with CUDA only 5 applies):
1. Without CUDA, `torch.cuda.current_device` returns the CPU device: megatron allocates its
   buffers (DDP grad buffers, pipeline p2p tensors) with `device=torch.cuda.current_device()`,
   which raises on a machine without CUDA.
2. Without CUDA, megatron's optimizer, gradient-norm, pipeline-schedule and utility modules
   (`optimizer/optimizer.py`, `optimizer/clip_grads.py`, `pipeline_parallel/schedules.py`,
   `utils.py`: its apex-less multi-tensor l2 norm) see a
   `torch` whose `tensor` and `zeros` put what they ask to be on `'cuda'` on the CPU: they create
   a few scalars (the unit loss scale, the apex overflow flag, the norm, the token count) with a
   literal `device='cuda'`. Only these modules' name `torch` is replaced; everything else they
   use is torch's own.
3. Without CUDA, gradients are clipped by `clip_grad_by_total_norm_fp32` of this module (the
   same scaling: max_norm / (norm + 1e-6) when below 1), not megatron's: megatron's asserts that
   each gradient's `type()` is `torch.cuda.FloatTensor`. The norm is still megatron's
   (`get_grad_norm_fp32`, over the model-parallel ranks).
4. Not a patch, a choice (`optimizer.py`): without CUDA the optimizer is megatron's FP32Optimizer
   (AdamW, optimizer state whole on every data-parallel rank), since megatron's distributed
   optimizer refuses parameters whose `type()` is not a `torch.cuda.*Tensor`; on CUDA it is the
   distributed optimizer (state sharded over the data-parallel ranks).
5. The RNG trackers are seeded with `model_parallel_cuda_manual_seed(seed,
   inference_rng_tracker=True)` on a CPU: the default tracker forks CUDA RNG states.
6. Without CUDA, the rotary embeddings (rope and Qwen2-VL's M-RoPE) take this rank's context-parallel
   slice of the full sequence's embedding with `get_pos_emb_on_this_cp_rank` of this module (the
   same chunks: r and 2 * cp - 1 - r of 2 * cp), not megatron's, which moves its chunk index through
   pinned memory to `.cuda()`.
7. Without CUDA, activation recompute (`megatron.recompute`) saves and restores the CPU generator's
   state where megatron's checkpoint function saves and restores the CUDA one
   (`tensor_parallel.random._get_cuda_rng_state` / `_set_cuda_rng_state`), so the recomputed forward
   draws the same random numbers (dropout) as the first.
Models are built with `use_cpu_initialization` and every forward gets an explicit attention mask
(megatron's unfused softmax has no implicit causal mask on CPU): `model.py`, `engine.py`.
"""

from __future__ import annotations

import torch

_applied = False


def apply_shims() -> None:
    global _applied
    if _applied:
        return
    _applied = True
    if torch.cuda.is_available():
        return
    torch.cuda.current_device = _cpu_device
    from megatron.core import utils
    from megatron.core.models.common.embeddings import rotary_pos_embedding
    from megatron.core.optimizer import clip_grads, optimizer
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.tensor_parallel import random

    for module in (optimizer, clip_grads, schedules, utils):
        module.torch = _CpuTorch()
    optimizer.clip_grad_by_total_norm_fp32 = clip_grad_by_total_norm_fp32
    rotary_pos_embedding.get_pos_emb_on_this_cp_rank = get_pos_emb_on_this_cp_rank
    random._get_cuda_rng_state = _get_cpu_rng_state
    random._set_cuda_rng_state = _set_cpu_rng_state


def get_pos_emb_on_this_cp_rank(pos_emb: torch.Tensor, seq_dim: int, cp_group) -> torch.Tensor:
    """megatron's `get_pos_emb_on_this_cp_rank` with its chunk index on the CPU (shim 6): the
    chunks r and 2 * cp - 1 - r of `pos_emb` cut into 2 * cp along `seq_dim`."""
    cp_size, cp_rank = cp_group.size(), cp_group.rank()
    chunks = pos_emb.view(*pos_emb.shape[:seq_dim], 2 * cp_size, -1, *pos_emb.shape[seq_dim + 1:])
    mine = chunks.index_select(seq_dim, torch.tensor([cp_rank, 2 * cp_size - 1 - cp_rank], device=pos_emb.device))
    return mine.view(*pos_emb.shape[:seq_dim], -1, *pos_emb.shape[seq_dim + 1:])


def clip_grad_by_total_norm_fp32(parameters, max_norm: float, total_norm: float,
                                 use_decoupled_grad: bool = False) -> None:
    """megatron's `clip_grad_by_total_norm_fp32` without its CUDA type check (shim 3)."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    attribute = "decoupled_grad" if use_decoupled_grad else "grad"
    grads = [getattr(p, attribute).detach() for p in parameters if getattr(p, attribute, None) is not None]
    coefficient = max_norm / (total_norm + 1.0e-6)
    if coefficient < 1.0 and grads:
        torch._foreach_mul_(grads, coefficient)


def _get_cpu_rng_state(device: object = None, clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
    """The CPU generator's state in place of a CUDA device's (shim 7)."""
    return torch.get_rng_state()


def _set_cpu_rng_state(new_state: torch.Tensor, device: object = None, graph_safe: bool = False) -> None:
    """Restores the CPU generator's state in place of a CUDA device's (shim 7)."""
    torch.set_rng_state(new_state)


def _cpu_device() -> torch.device:
    return torch.device("cpu")


def _on_cpu(device):
    return "cpu" if isinstance(device, str) and device.startswith("cuda") else device


class _CpuTorch:
    """torch, with `tensor` and `zeros` creating on the CPU what asks for `'cuda'` (shim 2)."""

    def __getattr__(self, name: str):
        return getattr(torch, name)

    @staticmethod
    def tensor(*args, device=None, **kwargs):
        return torch.tensor(*args, device=_on_cpu(device), **kwargs)

    @staticmethod
    def zeros(*args, device=None, **kwargs):
        return torch.zeros(*args, device=_on_cpu(device), **kwargs)


def seed_model_parallel(seed: int) -> None:
    """megatron's RNG trackers seeded (tensor-parallel ranks differ, data-parallel ranks agree)."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed, inference_rng_tracker=not torch.cuda.is_available())
