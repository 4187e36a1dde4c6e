"""The train-engine seam: what a model-holding stage asks of its training backend.

    engine = build_train_engine(cfg, "actor_train", checkpoint, ctx.group, cfg.actor)  # engines.py
    logp = engine.forward_logprobs(sequences, temperature)       # a mini-batch, split over the ranks
    metrics = engine.train_step(part, loss_fn, per_sample)       # one optimizer step
    store.publish(engine.export_weights(), version)              # Hugging Face names, full tensors

Stage logic (`stages/`) keeps what to compute: losses and advantages (`algos/`), staleness,
versions. An engine owns the model (`build_train_engine` loads it from the checkpoint folder),
its device, its optimizer and how the ranks of the stage instance share the work. Every rank of
the instance calls the same methods in the same order (collectives inside); results are the same
on every rank.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import torch
from torch import Tensor

from stream_rlhf.distributed import RankGroup
from stream_rlhf.experience import Experience
from stream_rlhf.samples import SampleImages
from stream_rlhf.weights.offload_config import OffloadTarget

Offloadable = OffloadTarget
LossFn = Callable[[Experience, dict[str, Tensor]], tuple[Tensor, dict[str, Tensor]]]
"""(this rank's samples, their per-sample tensors) -> (token-mean loss, metrics as 0-dim tensors the
engine reads to the host at once, `algos.losses.host_metrics`)."""


class TrainEngine(Protocol):
    group: RankGroup
    device: torch.device

    def logprobs(self, sequences: list[Tensor], temperature: float, with_entropy: bool = False,
                 images: list[SampleImages] | None = None,
                 prompt_lens: Tensor | None = None) -> tuple[list[Tensor], list[Tensor] | None]:
        """(L_i - 1,) log-probs (and entropies) of this rank's sequences; gradients flow (inside a
        loss). `prompt_lens` (N,): samples of the same prompt may share its forward (same result)."""

    def values(self, sequences: list[Tensor], images: list[SampleImages] | None = None,
               prompt_lens: Tensor | None = None) -> list[Tensor]:
        """(L_i - 1,) values of this rank's sequences, position t valuing the state before token t + 1."""

    def response_logprobs(self, part: Experience, temperature: float,
                          with_entropy: bool = False) -> tuple[Tensor, Tensor | None]:
        """`logprobs` of `part`'s response tokens as (n, R) tensors (R = part.mask's width), zero
        after each response, as `part.padded(response_slices(...))` gives them: a loss's input."""

    def response_values(self, part: Experience) -> Tensor:
        """`values` at the positions predicting `part`'s response tokens, (n, R) like `response_logprobs`."""

    def forward_logprobs(self, sequences: list[Tensor], temperature: float,
                         images: list[SampleImages] | None = None, prompt_lens: Tensor | None = None) -> list[Tensor]:
        """(L_i - 1,) log-probs of a whole mini-batch, no gradient: each rank computes its share and
        every rank gets all of them, on the CPU."""

    def forward_values(self, sequences: list[Tensor], images: list[SampleImages] | None = None,
                       prompt_lens: Tensor | None = None) -> list[Tensor]:
        """`values` of a whole mini-batch, shared like `forward_logprobs`."""

    def forward_response_logprobs(self, exp: Experience, temperature: float, base: bool = False) -> Tensor:
        """(N, R) `response_logprobs` of a whole mini-batch, no gradient, shared like `forward_logprobs`.
        `base`: the model's without its LoRA adapters (ValueError when it has none)."""

    def train_step(self, part: Experience, loss_fn: LossFn, per_sample: dict[str, Tensor]) -> dict[str, float]:
        """One optimizer step on `part`: each rank takes its share of the samples (and of each
        (N, ...) tensor of `per_sample`), and the gradient is that of the token mean over all of
        them. Returns the loss function's metrics (token-weighted over the ranks), `loss` and
        `grad_norm` (before clipping)."""

    def export_weights(self, trainable_only: bool = False) -> dict[str, Tensor]:
        """Full tensors in Hugging Face names, on the CPU (tied weights share one tensor)."""

    def snapshot_weights(self) -> dict[str, Tensor]:
        """`export_weights` as host copies training no longer changes, for a thread to write while
        the next steps run (`stages/weight_publish.py`); overwritten by the next call (every rank
        calls it, like `export_weights`)."""

    def trained_names(self) -> list[str]:
        """Hugging Face names of the trained parameters (a tied LM head once, as the embedding;
        no frozen vision tower): what weight sync sends to rollout."""

    def parameter_counts(self) -> tuple[int, int]:
        """(trained, all) parameters of the whole model, every rank's share together (a tied head
        once): what `actor.lora` saves, in the run summary."""

    def refresh(self, store: object, held: int) -> int:
        """Load the newest version of a `WeightStore` if newer than `held` (every rank the same
        version); returns the version held."""

    def save(self, folder: Path, tokenizer: object) -> None:
        """A Hugging Face checkpoint folder (written by the leader)."""

    def load(self, folder: Path) -> None:
        """The weights of a checkpoint folder `save` wrote, each rank its share."""

    def snapshot_state(self) -> dict | None:
        """Weights, optimizer state and RNG as one host copy that training no longer changes: what
        a checkpoint writes (`torch.save`), in the background while training goes on. Every rank
        calls it (gathers inside); the leader gets it, the others None."""

    def reserve_snapshot(self) -> None:
        """Allocate the host memory of the next `snapshot_state` ahead, in the background, where
        allocating it inside that call would stall a step (pinned memory for a GPU's state)."""

    def load_state(self, path: Path) -> None:
        """A saved `snapshot_state`, each rank its share."""

    def offload(self, what: set[Offloadable]) -> int:
        """Move `what` off the device to host memory (pinned on CUDA); the bytes moved (0 on a
        CPU device, where it already is). Offload policies call it (`weights/device_turns.py`)."""

    def onload(self, what: set[Offloadable]) -> int:
        """Bring back what `offload` moved; the bytes moved."""
