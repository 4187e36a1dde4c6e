"""megatron's DDP and distributed optimizer around a megatron model, as the engine uses them.

    opt = MegatronOptimizer(model, OptimizerConfig(lr=1e-4, max_grad_norm=1.0))
    opt.zero_grad(); <pipeline schedule with opt.ddp>; grad_norm = opt.step()

DDP keeps the gradients in contiguous fp32 buffers and averages them over the data-parallel ranks
when the schedule finishes (`finalize_model_grads`, which also sums a tied embedding's gradient
over the first and last pipeline stages); on CUDA the distributed optimizer (AdamW) holds each dp rank's
shard of the optimizer state, clips the gradient norm over every rank first and all-gathers the
updated parameters; on the CPU megatron's FP32Optimizer does the same with the whole state on
every dp rank (the distributed optimizer insists on CUDA tensors: `shim.py`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig as CoreOptimizerConfig
from megatron.core.optimizer import get_megatron_optimizer
from torch import Tensor, nn

from stream_rlhf.backends.optimizer_config import OptimizerConfig
from stream_rlhf.distributed import RankGroup


class MegatronOptimizer:
    def __init__(self, model: nn.Module, config: OptimizerConfig, distributed: bool | None = None):
        """`distributed`: megatron's distributed optimizer, else its FP32Optimizer (the whole state on
        every dp rank); None picks the distributed one exactly when `model` is on CUDA (it refuses
        CPU tensors: `shim.py`, 4)."""
        model.config.finalize_model_grads_func = finalize_model_grads
        if distributed is None:
            distributed = next(model.parameters()).is_cuda
        self.ddp = DistributedDataParallel(
            config=model.config, module=model,
            ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=distributed))
        self.optimizer = get_megatron_optimizer(
            CoreOptimizerConfig(optimizer="adam", lr=config.lr, min_lr=config.lr, weight_decay=config.weight_decay,
                                adam_beta1=0.9, adam_beta2=0.999, adam_eps=1e-8, clip_grad=config.max_grad_norm,
                                use_distributed_optimizer=distributed, bf16=False, fp16=False,
                                params_dtype=torch.float32),
            [self.ddp])

    def zero_grad(self) -> None:
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()

    def step(self) -> float:
        """Clip and step; returns the gradient norm before clipping (over every rank)."""
        ok, grad_norm, _ = self.optimizer.step()
        if not ok:
            raise RuntimeError("megatron optimizer: the step was skipped (non-finite gradients)")
        return float(grad_norm)

    def main_grads(self) -> list[Tensor]:
        """The gradients the torch optimizer steps on (for an fp32 model, views of DDP's buffers)."""
        return [p.grad for group in self._inner().param_groups for p in group["params"] if p.grad is not None]

    def state_tensors(self) -> list[Tensor]:
        """The torch optimizer's state tensors (AdamW's moments, not its scalar step counts)."""
        return [v for state in self._inner().state.values() for v in state.values()
                if isinstance(v, Tensor) and v.dim() > 0]

    def gather_state(self, group: RankGroup) -> list[dict] | None:
        """Every rank's optimizer state (its shard), in rank order, on the leader (None elsewhere)."""
        mine = self._inner().state_dict()
        if not group.distributed:
            return [mine]
        shards = [None] * group.world_size if group.is_leader else None
        dist.gather_object(mine, shards, dst=0)
        return shards

    def load_shard(self, state: dict) -> None:
        self._inner().load_state_dict(state)

    def _inner(self) -> torch.optim.Optimizer:
        """The torch optimizer over this rank's shard of the fp32 main parameters."""
        chained = getattr(self.optimizer, "chained_optimizers", [self.optimizer])
        if len(chained) != 1:
            raise RuntimeError(f"megatron optimizer: {len(chained)} chained optimizers, expected one")
        return chained[0].optimizer
