"""How a training step fits in memory (`actor.*`, `critic.*`; micro-batches on megatron too):

- micro-batches (`micro_batch_tokens`): a rank's share of an optimizer step in runs of whole
  samples, in order, each computing at most the token budget (a prompt its samples share counted
  once, as the packing runs it; a sample longer than the budget alone), whose gradients
  accumulate: the step holds one run's activations, not the whole step's. The engine scales each
  run's token-mean loss by its share of the rank's tokens, so the sum is exactly the one pass's
  gradient (`torch_engine.TorchTrainEngine.train_step`, `megatron/engine.py`);
- activation checkpointing (`gradient_checkpointing`, the torch engine's): each decoder layer's
  activations are recomputed in the backward pass instead of kept.

    runs = micro_batches(sequences, 4096, prompt_lens)   # [tensor([0, 1, 2]), tensor([3]), ...]; None: one run
    checkpoint_activations(model)                        # the Hugging Face model's own switch
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


def micro_batches(sequences: list[Tensor], budget: int | None, prompt_lens: Tensor | None = None) -> list[Tensor]:
    """Runs of sample indices (greedy, in order) computing at most `budget` tokens each: a
    sample's tokens, less its prompt when an earlier sample of its run has the same one and
    `prompt_lens` (N,) says where prompts end (the packing then shares it: text models,
    `models/packing.pack_shared`). One run of every sample when `budget` is None."""
    if budget is None or not sequences:
        return [torch.arange(len(sequences))]
    runs: list[list[int]] = [[]]
    held = 0
    prompts: set[tuple[int, ...]] = set()  # the prompts the current run holds
    for index, sequence in enumerate(sequences):
        prompt = int(prompt_lens[index]) if prompt_lens is not None else 0
        key = tuple(sequence[:prompt].tolist()) if 0 < prompt < len(sequence) else None
        cost = len(sequence) - prompt if key in prompts else len(sequence)
        if runs[-1] and held + cost > budget:
            runs.append([])
            held, prompts, cost = 0, set(), len(sequence)
        runs[-1].append(index)
        held += cost
        if key is not None:
            prompts.add(key)
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
