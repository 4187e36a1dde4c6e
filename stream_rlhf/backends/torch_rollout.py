"""Batched sampling with a KV cache over a Hugging Face causal LM: the plain-torch rollout backend.

    params = SamplingParams(temperature=0.7, top_p=0.95, max_new_tokens=64, stop_token_ids=(eos,))
    gen = generate(model, prompts, params, generator=torch.Generator().manual_seed(0))
    gen.response_ids[i], gen.response_logp[i], gen.finish_reasons[i]

Prompts are left-padded into one batch; position ids come from the attention mask, so padding does
not shift positions and each row decodes exactly as it would alone. One prefill, then one token
per step for every row through a DynamicCache; rows that finished keep being fed padding (their
outputs are ignored) until all rows have finished or `max_new_tokens` is reached.

Behaviour log-probs: the recorded log-prob of each sampled token is taken under the FULL tempered
distribution softmax(logits / temperature), not the top-p-truncated one that was sampled from, so
it equals what a later forward pass recomputes with `sequence_logprobs(..., temperature)`
(both go through `stream_rlhf.kernels.logprob`).
With temperature 0 (greedy) it is the log-prob under the untempered distribution.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from transformers import DynamicCache

from stream_rlhf.kernels.logprob import logprobs_from_logits


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    """Logits are divided by it before sampling; 0 = greedy (argmax)."""
    top_p: float = 1.0
    """Nucleus sampling: sample only from the smallest set of tokens whose mass reaches top_p."""
    max_new_tokens: int = 16
    """At most this many response tokens per prompt (finish reason "length" when reached)."""
    stop_token_ids: tuple[int, ...] = ()
    """Sampling one of these ends the response (included in it; finish reason "stop")."""
    pad_token_id: int = 0
    """Fills the left of short prompts and is fed to rows that have finished."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature={self.temperature}: must be >= 0 and finite")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p}: must be in (0, 1]")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens}: must be >= 1")
        if not isinstance(self.stop_token_ids, tuple) or any(t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids={self.stop_token_ids!r}: must be a tuple of token ids >= 0")
        if self.pad_token_id < 0:
            raise ValueError(f"pad_token_id={self.pad_token_id}: must be >= 0")


@dataclass
class Generation:
    """One response per prompt, in prompt order; tensors on the CPU."""

    response_ids: list[Tensor]
    """(R_i,) long; includes the stop token when one was sampled."""
    response_logp: list[Tensor]
    """(R_i,) fp32 behaviour log-prob of each response token (full tempered distribution)."""
    finish_reasons: list[str]
    """Either "stop" (a stop token was sampled) or "length" (max_new_tokens reached)."""


def _sample(logits: Tensor, params: SamplingParams, generator: torch.Generator | None) -> Tensor:
    """Next token per row from logits (B, V) -> (B,): argmax, or top-p sampling at temperature."""
    if params.temperature == 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / params.temperature, dim=-1)  # (B, V)
    if params.top_p < 1:
        sorted_probs, order = probs.sort(dim=-1, descending=True, stable=True)  # (B, V)
        # drop a token once the mass before it already reaches top_p; the most likely one stays
        drop = sorted_probs.cumsum(-1) - sorted_probs >= params.top_p  # (B, V)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs.masked_fill(drop, 0.0))
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def _left_pad(prompts: list[Tensor], pad_token_id: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """Prompts (P_i,) -> input_ids (B, P) and attention mask (B, P) long, padding on the left."""
    width = max(p.numel() for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long, device=device)
    attention = torch.zeros((len(prompts), width), dtype=torch.long, device=device)
    for i, prompt in enumerate(prompts):
        input_ids[i, width - prompt.numel() :] = prompt.to(device)
        attention[i, width - prompt.numel() :] = 1
    return input_ids, attention


@torch.inference_mode()
def generate(
    model: nn.Module, prompts: list[Tensor], params: SamplingParams, generator: torch.Generator | None = None
) -> Generation:
    """Sample one response per prompt (P_i,); `generator` must live on the model's device."""
    if not prompts:
        return Generation([], [], [])
    if min(p.numel() for p in prompts) < 1:
        raise ValueError("prompts: every prompt must have at least one token")
    device = next(model.parameters()).device
    input_ids, attention = _left_pad(prompts, params.pad_token_id, device)  # (B, P), (B, P)
    position_ids = (attention.cumsum(-1) - 1).clamp(min=0)  # (B, P)
    stop_ids = torch.tensor(params.stop_token_ids, dtype=torch.long, device=device)
    cache = DynamicCache()
    out = model(
        input_ids,
        attention_mask=attention,
        position_ids=position_ids,
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=1,
    )
    next_position = position_ids[:, -1:] + 1  # (B, 1)

    batch = len(prompts)
    finished = torch.zeros(batch, dtype=torch.bool, device=device)  # (B,)
    stopped = torch.zeros(batch, dtype=torch.bool, device=device)  # (B,)
    n_tokens = torch.zeros(batch, dtype=torch.long, device=device)  # (B,) response length so far
    tokens: list[Tensor] = []  # each (B,)
    logps: list[Tensor] = []  # each (B,)
    for step in range(params.max_new_tokens):
        logits = out.logits[:, -1]  # (B, V)
        token = _sample(logits, params, generator)  # (B,)
        logps.append(logprobs_from_logits(logits, token, params.temperature)[0])
        token = token.masked_fill(finished, params.pad_token_id)
        tokens.append(token)
        n_tokens += (~finished).long()
        stopped |= ~finished & torch.isin(token, stop_ids)
        finished |= stopped
        if step == params.max_new_tokens - 1 or bool(finished.all()):
            break
        attention = torch.cat([attention, torch.ones_like(attention[:, :1])], dim=1)  # (B, P + step + 1)
        out = model(
            token[:, None], attention_mask=attention, position_ids=next_position, past_key_values=cache, use_cache=True
        )
        next_position = next_position + 1

    all_tokens = torch.stack(tokens, dim=1).cpu()  # (B, S)
    all_logps = torch.stack(logps, dim=1).cpu()  # (B, S)
    lengths = n_tokens.tolist()
    return Generation(
        response_ids=[all_tokens[i, :n].clone() for i, n in enumerate(lengths)],
        response_logp=[all_logps[i, :n].clone() for i, n in enumerate(lengths)],
        finish_reasons=["stop" if s else "length" for s in stopped.tolist()],
    )
