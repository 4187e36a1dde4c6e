"""The Medusa heads' training loss: each head's cross-entropy on the response tokens it would draft.

    loss, metrics = heads_loss(heads, hidden, sequences, prompt_lens)   # metrics: head{k}_loss, head{k}_acc

The heads themselves (`MedusaHeads`: residual block + vocabulary projection per head) are
`models/medusa.py`; the hidden states are the frozen backbone's (`models/packing.py`:
`packed_hidden_states`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

if TYPE_CHECKING:  # the heads' type only
    from stream_rlhf.models.medusa import MedusaHeads


def heads_loss(heads: MedusaHeads, hidden: list[Tensor], sequences: list[Tensor],
               prompt_lens: list[int]) -> tuple[Tensor, dict[str, Tensor]]:
    """Cross-entropy of each head on the response tokens it would draft, and its top-1 accuracy
    (0-dim tensors, left on the device: `losses.host_metrics` reads them in one copy).

    `hidden` (L_i, H) are the backbone's last hidden states of `sequences` (L_i,). Rollout drafts
    from the hidden state of a kept position t >= P - 1 (P: prompt length), head k predicting token
    t + 2 + k, so those are the positions trained: t in [P - 1, L - 3 - k].
    """
    losses, metrics = [], {}
    for k in range(heads.num_heads):
        inputs, targets = [], []
        for h, seq, p in zip(hidden, sequences, prompt_lens):
            last = len(seq) - 3 - k  # the last t whose target t + 2 + k is in the sequence
            if last >= p - 1:
                inputs.append(h[p - 1:last + 1])
                targets.append(seq[p + 1 + k:])
        if not inputs:
            continue
        logits = heads.projections[k](heads.blocks[k](torch.cat(inputs)))  # (N_k, V)
        target = torch.cat(targets).long().to(logits.device)  # (N_k,)
        losses.append(nn.functional.cross_entropy(logits.float(), target))
        metrics[f"head{k}_loss"] = losses[-1].detach()
        metrics[f"head{k}_acc"] = (logits.argmax(-1) == target).float().mean()
    if not losses:
        return torch.zeros((), requires_grad=True), metrics
    return torch.stack(losses).sum(), metrics
