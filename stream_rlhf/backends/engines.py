"""The train engine a forward or training stage holds, chosen from one table by
`placement.stages.<stage>.backend`; it loads the stage's model from the checkpoint folder itself:

    engine = build_train_engine(job.config, "actor_train", job.checkpoint, ctx.group, cfg.actor)

| stage                                         | model (`STAGE_MODELS`)                              |
|-----------------------------------------------|-----------------------------------------------------|
| `actor_train`, `actor_forward`, `ref_forward` | the policy (`load_policy`)                          |
| `critic_train`, `critic_forward`              | the critic `critic.init` says (`load_job_critic`)   |

| backend    | engine                                                    | needs              |
|------------|-----------------------------------------------------------|--------------------|
| `torch`    | `torch_engine.TorchTrainEngine` (HF model, FSDP2)         | -                  |
| `megatron` | `megatron.engine.MegatronTrainEngine` (tp x pp x cp x dp) | the megatron extra |
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from torch import nn

from stream_rlhf.backends.kernel_warm_up import warm_up_logprob_kernels
from stream_rlhf.backends.optimizer_config import OptimizerConfig
from stream_rlhf.backends.precision import Precision, resolve_precision
from stream_rlhf.backends.torch_engine import TorchTrainEngine
from stream_rlhf.backends.train_engine import TrainEngine
from stream_rlhf.distributed import RankGroup
from stream_rlhf.models.checkpoint import load_job_critic, load_policy
from stream_rlhf.models.lora import add_lora
from stream_rlhf.models.lora_config import LoRAConfig

if TYPE_CHECKING:  # the job's config, read here: the launcher's package is above the engines
    from stream_rlhf.launch.placement import StagePlacement
    from stream_rlhf.rl.config import RLJobConfig

log = logging.getLogger("stream_rlhf")


def _torch(model: nn.Module, group: RankGroup, optimizer: OptimizerConfig | None, own: StagePlacement,
           stage: str, seed: int, precision: Precision, micro_batch_tokens: int | None) -> TrainEngine:
    engine = TorchTrainEngine(model, group, optimizer, precision, micro_batch_tokens)
    warm_up_logprob_kernels(engine, trains=optimizer is not None)  # compiles here, not in the first steps
    return engine


def _megatron(model: nn.Module, group: RankGroup, optimizer: OptimizerConfig | None, own: StagePlacement,
              stage: str, seed: int, precision: Precision, micro_batch_tokens: int | None) -> TrainEngine:
    from stream_rlhf.backends.megatron.config import check_parallel
    from stream_rlhf.backends.megatron.engine import MegatronTrainEngine  # megatron-core: the megatron extra
    from stream_rlhf.backends.megatron.model import text_config

    cfg = text_config(model.config)
    check_parallel(own.megatron, group.world_size, cfg.num_attention_heads, cfg.num_key_value_heads,
                   cfg.num_hidden_layers, f"placement.stages.{stage}.megatron")
    return MegatronTrainEngine(model, group, optimizer, own.megatron, seed, micro_batch_tokens, precision)


TRAIN_ENGINES: dict[str, Callable[..., TrainEngine]] = {"torch": _torch, "megatron": _megatron}


def _policy(config: RLJobConfig, checkpoint: str) -> nn.Module:
    return load_policy(checkpoint)


STAGE_MODELS: dict[str, Callable[[RLJobConfig, str], nn.Module]] = {
    "actor_train": _policy,
    "actor_forward": _policy,
    "ref_forward": _policy,
    "critic_train": load_job_critic,
    "critic_forward": load_job_critic,
}
"""Stage -> the model its engine loads from the job's checkpoint folder."""


def _with_lora(model: nn.Module, lora: LoRAConfig, seed: int, key: str) -> None:
    """Adapters on `model` (`models/lora.py`, config `key`), which then trains those only (and a
    critic's head); logs how much trains."""
    wrapped = add_lora(model, lora, seed, key)
    total = sum(p.numel() for p in model.parameters())  # the adapters included, as summary.json counts
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    log.info("LoRA rank %d (alpha %g) on %d linear layers: %s of %s parameters train (%.2f%%)", lora.rank,
             lora.alpha, len(wrapped), f"{trained:,}", f"{total:,}", 100 * trained / total)


def build_train_engine(config: RLJobConfig, stage: str, checkpoint: str, group: RankGroup,
                       optimizer: OptimizerConfig | None = None) -> TrainEngine:
    """The engine of `stage` (an `RLJobConfig`'s placement says which) holding the stage's model,
    loaded from `checkpoint` (`STAGE_MODELS`); trains with `optimizer`, forward only without. The
    trainers' models get `actor.lora`'s and `critic.lora`'s adapters first, when set (the torch
    engine's: the config refuses them on megatron), and every stage of a model takes its trainer's
    `micro_batch_tokens`."""
    if stage not in STAGE_MODELS:
        raise ValueError(f"build_train_engine: stage {stage!r} holds no train engine (one of {sorted(STAGE_MODELS)})")
    own = config.placement.of(stage)
    model = STAGE_MODELS[stage](config, checkpoint)
    trainer = config.actor if STAGE_MODELS[stage] is _policy else config.critic  # whose model it is
    if trainer.lora is not None and stage in ("actor_train", "critic_train"):
        _with_lora(model, trainer.lora, config.seed, f"{stage.partition('_')[0]}.lora")
    details = [f"{own.backend} engine", resolve_precision(config.precision, group.device)]
    if trainer.micro_batch_tokens is not None:
        details.append(f"micro-batches of at most {trainer.micro_batch_tokens} tokens")
    log.info("%s: %s", stage, ", ".join(details))
    return TRAIN_ENGINES[own.backend](model, group, optimizer, own, stage, config.seed, config.precision,
                                      trainer.micro_batch_tokens)
