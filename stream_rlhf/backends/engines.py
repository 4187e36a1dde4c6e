"""The train engine a forward or training stage holds, chosen from one table by
`placement.stages.<stage>.backend`:

    engine = build_train_engine(job.config, "actor_train", load_policy(path), ctx.group, cfg.actor)

| backend    | engine                                                    | needs              |
|------------|-----------------------------------------------------------|--------------------|
| `torch`    | `torch_engine.TorchTrainEngine` (HF model, FSDP2)         | -                  |
| `megatron` | `megatron.engine.MegatronTrainEngine` (tp x pp x cp x dp) | the megatron extra |
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from torch import nn

from stream_rlhf.backends.optimizer_config import OptimizerConfig
from stream_rlhf.backends.precision import Precision
from stream_rlhf.backends.torch_engine import TorchTrainEngine
from stream_rlhf.backends.train_engine import TrainEngine
from stream_rlhf.distributed import RankGroup

if TYPE_CHECKING:  # the job's config, read here: the launcher's package is above the engines
    from stream_rlhf.launch.placement import StagePlacement
    from stream_rlhf.rl.config import RLJobConfig


def _torch(model: nn.Module, group: RankGroup, optimizer: OptimizerConfig | None, own: StagePlacement,
           stage: str, seed: int, precision: Precision) -> TrainEngine:
    return TorchTrainEngine(model, group, optimizer, precision)


def _megatron(model: nn.Module, group: RankGroup, optimizer: OptimizerConfig | None, own: StagePlacement,
              stage: str, seed: int, precision: Precision) -> TrainEngine:
    from stream_rlhf.backends.megatron.config import check_parallel
    from stream_rlhf.backends.megatron.engine import MegatronTrainEngine  # megatron-core: the megatron extra
    from stream_rlhf.backends.megatron.model import text_config

    cfg = text_config(model.config)
    check_parallel(own.megatron, group.world_size, cfg.num_attention_heads, cfg.num_key_value_heads,
                   cfg.num_hidden_layers, f"placement.stages.{stage}.megatron")
    return MegatronTrainEngine(model, group, optimizer, own.megatron, seed)


TRAIN_ENGINES: dict[str, Callable[..., TrainEngine]] = {"torch": _torch, "megatron": _megatron}


def build_train_engine(config: RLJobConfig, stage: str, model: nn.Module, group: RankGroup,
                       optimizer: OptimizerConfig | None = None) -> TrainEngine:
    """The engine of `stage` (an `RLJobConfig`'s placement says which) holding `model`; trains with
    `optimizer`, forward only without."""
    own = config.placement.of(stage)
    return TRAIN_ENGINES[own.backend](model, group, optimizer, own, stage, config.seed, config.precision)
