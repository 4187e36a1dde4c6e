"""Medusa heads: extra decoding heads on a causal LM's last hidden state, each predicting a token
further ahead, for lossless speculative rollout (`backends/speculative.py`).

    heads = MedusaHeads.from_policy(policy, num_heads=3)   # vocabulary projections copy the LM head
    logits = heads(hidden)                                 # (K, ..., V): head k predicts token t + 2 + k
    save_heads(heads, folder); heads = load_heads(folder)   # folder/medusa/heads.safetensors

Head k (0-based) reads the hidden state at position t (the one the LM head turns into the logits
of token t + 1) and predicts token t + 2 + k. Each head is a residual block (Linear + SiLU, zero-
initialised, so a new head starts as the LM head itself) followed by its own vocabulary projection,
initialised from the LM head. The backbone is never changed by them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from stream_rlhf.atomic_file import write_text_atomically

HEADS_FOLDER = "medusa"
"""The heads live in this subfolder of a checkpoint: a `*.safetensors` file at the top would be
loaded as part of the policy by vLLM (which reads every one there) and fail."""
WEIGHTS_FILE = "heads.safetensors"
CONFIG_FILE = "heads.json"


class ResidualBlock(nn.Module):
    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: Tensor) -> Tensor:
        return x + nn.functional.silu(self.linear(x))


class MedusaHeads(nn.Module):
    def __init__(self, hidden_size: int, vocab_size: int, num_heads: int):
        super().__init__()
        if num_heads < 1:
            raise ValueError(f"num_heads={num_heads}: must be >= 1")
        self.hidden_size, self.vocab_size, self.num_heads = hidden_size, vocab_size, num_heads
        self.blocks = nn.ModuleList(ResidualBlock(hidden_size) for _ in range(num_heads))
        self.projections = nn.ModuleList(nn.Linear(hidden_size, vocab_size, bias=False) for _ in range(num_heads))

    @classmethod
    def from_policy(cls, policy: nn.Module, num_heads: int) -> MedusaHeads:
        """New heads for `policy` (a Hugging Face causal LM): each projection is a copy of its LM head."""
        head = policy.get_output_embeddings()
        vocab_size, hidden_size = head.weight.shape
        heads = cls(hidden_size, vocab_size, num_heads).to(head.weight.device, head.weight.dtype)
        with torch.no_grad():
            for projection in heads.projections:
                projection.weight.copy_(head.weight)
        return heads

    def forward(self, hidden: Tensor) -> Tensor:
        """Logits (K, ..., V) of every head from hidden states (..., H)."""
        return torch.stack([proj(block(hidden)) for block, proj in zip(self.blocks, self.projections)])


def heads_folder(checkpoint: str | Path) -> Path:
    return Path(checkpoint) / HEADS_FOLDER


def save_heads(heads: MedusaHeads, checkpoint: str | Path) -> None:
    """Write the heads into `checkpoint`'s heads folder; each file appears whole or not at all."""
    folder = heads_folder(checkpoint)
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f"{WEIGHTS_FILE}.tmp-{os.getpid()}"
    save_file({k: v.contiguous() for k, v in heads.state_dict().items()}, tmp)
    os.replace(tmp, folder / WEIGHTS_FILE)
    write_text_atomically(folder / CONFIG_FILE, json.dumps({"hidden_size": heads.hidden_size,
                                                            "vocab_size": heads.vocab_size,
                                                            "num_heads": heads.num_heads}))


def load_heads(checkpoint: str | Path) -> MedusaHeads:
    folder = heads_folder(checkpoint)
    heads = MedusaHeads(**json.loads((folder / CONFIG_FILE).read_text()))
    heads.load_state_dict(load_file(folder / WEIGHTS_FILE))
    return heads


def has_heads(checkpoint: str | Path) -> bool:
    return (heads_folder(checkpoint) / WEIGHTS_FILE).is_file()


def load_rollout_heads(checkpoint: str | Path, policy: nn.Module, num_heads: int) -> MedusaHeads:
    """The heads saved with `checkpoint` (by the warm start or a finished run), or new ones
    initialised from `policy`'s LM head when it has none or a different number."""
    if has_heads(checkpoint):
        heads = load_heads(checkpoint)
        if heads.num_heads == num_heads:
            return heads
    return MedusaHeads.from_policy(policy, num_heads)
