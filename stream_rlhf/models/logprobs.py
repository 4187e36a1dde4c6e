"""Per-token log-probabilities and entropies from logits: the one place they are computed.

    logp = token_logprobs(logits, labels, temperature)   # (..., V), (...) -> (...)
    ent = token_entropy(logits, temperature)             # (..., V) -> (...)

Rollout (behaviour log-probs), the reference model and the trainer all call these, so the numbers
they compare are computed the same way (in fp32). A fused Triton kernel will replace the bodies
behind the same signatures.

Temperature: logits are divided by `temperature` before the softmax; `temperature <= 0` (greedy
decoding) means 1.0, i.e. the log-probs of the untempered distribution.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _tempered(logits: Tensor, temperature: float) -> Tensor:
    logits = logits.float()
    return logits / temperature if temperature > 0 else logits


def token_logprobs(logits: Tensor, labels: Tensor, temperature: float = 1.0) -> Tensor:
    """log softmax(logits / temperature)[labels]: logits (..., V), labels (...) long -> (...) fp32."""
    scaled = _tempered(logits, temperature)  # (..., V)
    picked = scaled.gather(-1, labels.unsqueeze(-1)).squeeze(-1)  # (...)
    return picked - torch.logsumexp(scaled, dim=-1)


def token_entropy(logits: Tensor, temperature: float = 1.0) -> Tensor:
    """Entropy of softmax(logits / temperature): logits (..., V) -> (...) fp32, in nats."""
    logp = torch.log_softmax(_tempered(logits, temperature), dim=-1)  # (..., V)
    return -(logp.exp() * logp).sum(-1)
