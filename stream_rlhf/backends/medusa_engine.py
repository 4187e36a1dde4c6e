"""The train engine of the Medusa heads (torch, one device): it owns the heads, their optimizer, the
backward and the step, and the frozen copy of the policy whose last hidden states the heads read.

    engine = MedusaTrainEngine(checkpoint, num_heads=3, lr=1e-3, device=ctx.group.device)
    version = engine.refresh(actor_store, version)     # the newest actor weights into the backbone
    metrics = engine.train_step(part, heads_loss)      # one AdamW step of the heads: loss + loss_fn's metrics
    engine.publish(medusa_store, n, metadata)          # the heads for rollout's speculation
    torch.save(engine.snapshot_state(), path)          # heads and optimizer (run checkpoints)
    engine.load_state(path)
    engine.save(folder)                                # the heads into a checkpoint folder

The heads start from the checkpoint's (or from the LM head when it has none: `load_rollout_heads`);
the backbone never trains: its hidden states are computed without gradients.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

from stream_rlhf.algos.losses import host_metrics
from stream_rlhf.backends.host_snapshot import HostSnapshots
from stream_rlhf.experience import Experience
from stream_rlhf.models.checkpoint import load_policy
from stream_rlhf.models.medusa import MedusaHeads, load_rollout_heads, save_heads
from stream_rlhf.models.packing import packed_hidden_states
from stream_rlhf.weights.shm_store import WeightStore

HeadsLossFn = Callable[[MedusaHeads, list[Tensor], list[Tensor], list[int]], tuple[Tensor, dict[str, Tensor]]]
"""(heads, backbone hidden states (L_i, H), sequences (L_i,), prompt lengths) -> (loss, metrics):
`algos/medusa.py`'s `heads_loss`."""


class MedusaTrainEngine:
    def __init__(self, checkpoint: str | Path, num_heads: int, lr: float, device: torch.device | str):
        self.device = torch.device(device)
        self.backbone = load_policy(checkpoint).eval().requires_grad_(False).to(self.device)
        self.heads = load_rollout_heads(checkpoint, self.backbone, num_heads).train().to(self.device)
        self.optimizer = torch.optim.AdamW(self.heads.parameters(), lr=lr, weight_decay=0.0)
        self._snapshots = HostSnapshots()  # host copies of the state checkpoints write

    def refresh(self, store: WeightStore, held: int) -> int:
        """Load the newest policy version of `store` into the backbone if newer than `held`; the
        version held."""
        return store.refresh(self.backbone, held)

    def train_step(self, part: Experience, loss_fn: HeadsLossFn) -> dict[str, float]:
        """One optimizer step of the heads on `part`'s sequences; `loss` and the loss function's metrics."""
        with torch.no_grad():
            hidden = packed_hidden_states(self.backbone, part.sequences)
        loss, metrics = loss_fn(self.heads, hidden, part.sequences, part.prompt_lens.tolist())
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        return host_metrics({"loss": loss.detach(), **metrics})  # one read of the device per step

    def publish(self, store: WeightStore, version: int, metadata: dict[str, str]) -> None:
        """The heads as `version` of `store`."""
        store.publish(self.heads, version, metadata)

    def snapshot_state(self) -> dict:
        """Heads and optimizer state, as a host copy training no longer changes (`host_snapshot.py`)."""
        return self._snapshots.take({"heads": self.heads.state_dict(), "optimizer": self.optimizer.state_dict()})

    def load_state(self, path: Path) -> None:
        """A saved `snapshot_state` (`torch.save`), onto this engine's device."""
        saved = torch.load(path, map_location=self.device, weights_only=True)
        self.heads.load_state_dict(saved["heads"])
        self.optimizer.load_state_dict(saved["optimizer"])

    def save(self, folder: Path) -> None:
        """The heads into checkpoint `folder`'s heads folder (`models/medusa.py`)."""
        save_heads(self.heads, folder)
