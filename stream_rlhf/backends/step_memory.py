"""How a training step fits in memory (`actor.*`, `critic.*` of the torch backend):

- micro-batches (`micro_batch_tokens`): a rank's share of an optimizer step in runs of whole
  samples, in order, each at most the token budget (a sample longer than it alone), whose
  gradients accumulate: the step holds one run's activations, not the whole step's. The engine
  scales each run's token-mean loss by its share of the rank's tokens, so the sum is exactly the
  one pass's gradient (`torch_engine.TorchTrainEngine.train_step`);
- activation checkpointing (`gradient_checkpointing`): each decoder layer's activations are
  recomputed in the backward pass instead of kept.

    runs = micro_batches(lengths, budget=4096)   # [tensor([0, 1, 2]), tensor([3]), ...]; budget None: one run
    checkpoint_activations(model)                # the Hugging Face model's own switch
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


def micro_batches(lengths: Tensor, budget: int | None) -> list[Tensor]:
    """Runs of sample indices (greedy, in order) of at most `budget` tokens each, from each
    sample's tokens `lengths` (N,); one run of every sample when `budget` is None."""
    if budget is None or len(lengths) == 0:
        return [torch.arange(len(lengths))]
    runs: list[list[int]] = [[]]
    held = 0
    for index, length in enumerate(lengths.tolist()):
        if runs[-1] and held + length > budget:
            runs.append([])
            held = 0
        runs[-1].append(index)
        held += length
    return [torch.tensor(run, dtype=torch.long) for run in runs]


def accumulate(loss: Tensor | None, metrics: dict[str, Tensor], run_loss: Tensor, run_metrics: dict[str, Tensor],
                share: float) -> tuple[Tensor, dict[str, Tensor]]:
    """The step's loss and metrics so far with one micro-batch's added, weighted by its share of
    the rank's tokens (`*_max` metrics: the largest); on the device, read once at the step's end."""
    if loss is None:
        if share == 1.0:
            return run_loss, run_metrics
        loss, metrics = torch.zeros_like(run_loss), {}
    for name, value in run_metrics.items():
        if name.endswith("_max"):
            metrics[name] = torch.maximum(metrics[name], value) if name in metrics else value
        else:
            metrics[name] = metrics.get(name, 0.0) + value * share
    return loss + run_loss * share, metrics


def checkpoint_activations(model: nn.Module) -> None:
    """Recompute the decoder layers' activations in the backward pass (`gradient_checkpointing`),
    through the Hugging Face model's own switch (a vision-language critic's backbone's)."""
    for module in model.modules():
        if hasattr(module, "activation_checkpointing_enable"):  # transformers 5's name
            module.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
            return
        if hasattr(module, "gradient_checkpointing_enable"):  # older transformers (a GPU machine's)
            module.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            return
    raise TypeError(f"gradient_checkpointing: {type(model).__name__} holds no Hugging Face model to switch it on")
