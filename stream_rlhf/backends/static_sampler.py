"""The torch sampler over a static slot cache (`static_decode.py`): `torch_rollout.generate`'s
contract and, for the same generator, its tokens.

    gen = generate_static(model, static, prompts, params, generator)
    gen = sample(model, prompts, params, generator, images=None, static=static)   # static or eager

The prefill runs eagerly (its shape is the prompts'), into a `PreallocatedCache` whose rows then
join the slots of the bucket's cache (the samples of one prompt each get a copy). Each decode step
feeds every slot (finished and empty ones a pad token at position 0, their outputs unread) through
one fixed-shape forward, a CUDA graph replayed on CUDA. Sampling and the behaviour log-probs are
computed on the live rows only, in prompt order, exactly as the eager sampler draws them, so the
generator is consumed the same way and the tokens match. When the live rows fit a bucket half the
size, they move there (`SlotCache.take`), so the last steps of a few slow rows stay cheap.
Vision-language prompts (`images`) decode eagerly: their M-RoPE positions are not static.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from stream_rlhf.backends.kv_cache import PreallocatedCache, cache_argument
from stream_rlhf.backends.slot_cache import SlotCache
from stream_rlhf.backends.static_decode import StaticDecoder, StepForward, slot_bucket
from stream_rlhf.backends.torch_rollout import (
    Generation,
    SamplingParams,
    distinct_prompts,
    generate,
    generation_of,
    left_pad,
    sample_into,
)
from stream_rlhf.samples import SampleImages


def sample(model: nn.Module, prompts: list[Tensor], params: SamplingParams, generator: torch.Generator | None,
           images: list[SampleImages] | None = None, static: StaticDecoder | None = None) -> Generation:
    """`generate_static` with a static decoder and text prompts, `generate` otherwise."""
    if static is None or images is not None:
        return generate(model, prompts, params, generator, images=images)
    return generate_static(model, static, prompts, params, generator)


def prefill_into(static: StaticDecoder, decoder: nn.Module, prompts: list[Tensor], params: SamplingParams,
                 extra_positions: int, share_prompts: bool) -> tuple[SlotCache, Tensor, Tensor, Tensor]:
    """Prefill `prompts` through `decoder` (the model without its LM head) and join them to slots
    0..B-1 of a cache with room for `max_new_tokens + extra_positions` more positions; with
    `share_prompts` a prompt that comes several times is prefilled once (as `generate` does).
    Returns the cache, the prefilled rows' last hidden states (U, H), each prompt's prefilled row
    (B,) and each prompt's first decode position (B,)."""
    device = next(decoder.parameters()).device
    distinct, copies = distinct_prompts(prompts) if share_prompts else (prompts, None)
    input_ids, attention = left_pad(distinct, params.pad_token_id, device)  # (U, P), (U, P)
    position_ids = (attention.cumsum(-1) - 1).clamp(min=0)  # (U, P)
    prefill = PreallocatedCache(input_ids.shape[1])
    hidden = decoder(input_ids=input_ids, attention_mask=attention, position_ids=position_ids,
                     **cache_argument(decoder, prefill), use_cache=True).last_hidden_state[:, -1]  # (U, H)
    source = copies if copies is not None else torch.arange(len(prompts), device=device)  # (B,)
    cache = static.cache(len(prompts), input_ids.shape[1] + params.max_new_tokens + extra_positions, device)
    cache.join(torch.arange(len(prompts), device=device), prefill, source, attention[source])
    return cache, hidden, source, position_ids[source, -1] + 1


def slot_inputs(cache: SlotCache, slots: Tensor, tokens: Tensor, positions: Tensor,
                pad_token_id: int) -> tuple[Tensor, Tensor]:
    """Every slot's step inputs (S, Q): the live slots' `tokens` and `positions` (R, Q), pad at 0 elsewhere."""
    feed = torch.full((cache.slots, tokens.shape[1]), pad_token_id, dtype=torch.long, device=tokens.device)
    at = torch.zeros_like(feed)
    feed[slots], at[slots] = tokens, positions
    return feed, at


def compacted(static: StaticDecoder, cache: SlotCache, slots: Tensor) -> tuple[SlotCache, Tensor]:
    """The live `slots` moved to the bucket of their count when it is smaller; (cache, their slots)."""
    if slot_bucket(len(slots)) >= cache.slots:
        return cache, slots
    smaller = static.cache(len(slots), cache.capacity, cache.columns.device)
    smaller.take(cache, slots)
    return smaller, torch.arange(len(slots), device=slots.device)


def _sampler_forward(model: nn.Module) -> StepForward:
    decoder, lm_head = model.get_decoder(), model.get_output_embeddings()

    def forward(cache: SlotCache, tokens: Tensor, positions: Tensor) -> tuple[Tensor]:
        mask = cache.begin(tokens.shape[1])  # (S, 1, 1, C)
        hidden = decoder(input_ids=tokens, attention_mask=mask, position_ids=positions,
                         **cache_argument(decoder, cache), use_cache=True).last_hidden_state  # (S, 1, H)
        return (lm_head(hidden[:, -1]).float(),)  # (S, V)

    return forward


@torch.inference_mode()
def generate_static(model: nn.Module, static: StaticDecoder, prompts: list[Tensor], params: SamplingParams,
                    generator: torch.Generator | None = None) -> Generation:
    """Sample one response per text prompt (P_i,) as `generate` does, decoding over `static`'s caches."""
    if not prompts:
        return Generation([], [], [])
    if min(p.numel() for p in prompts) < 1:
        raise ValueError("prompts: every prompt must have at least one token")
    lm_head = model.get_output_embeddings()
    device = lm_head.weight.device
    cache, hidden, source, next_position = prefill_into(static, model.get_decoder(), prompts, params, 0, True)
    logits = lm_head(hidden).float()[source]  # (B, V)
    stop_ids = torch.tensor(params.stop_token_ids, dtype=torch.long, device=device)
    forward = _sampler_forward(model)

    batch, max_new = len(prompts), params.max_new_tokens
    out_ids = torch.full((batch, max_new), params.pad_token_id, dtype=torch.long, device=device)  # by prompt
    out_logp = torch.zeros((batch, max_new), device=device)
    lengths = torch.full((batch,), max_new, dtype=torch.long, device=device)  # final once a row leaves
    stopped = torch.zeros(batch, dtype=torch.bool, device=device)
    rows = torch.arange(batch, device=device)  # (R,) the prompts of the rows still decoding
    slots = rows.clone()  # (R,) their slots
    for step in range(max_new):  # logits: (R, V)
        token, stop = sample_into(logits, params, generator, stop_ids, out_ids, out_logp, rows, step)
        if step == max_new - 1:
            stopped[rows] = stop
            break
        if bool(stop.any()):  # rows that sampled a stop token leave: their slots are fed pad from now on
            lengths[rows[stop]], stopped[rows[stop]] = step + 1, True
            (live,) = stop.logical_not().nonzero(as_tuple=True)  # (R',)
            if len(live) == 0:
                break
            rows, slots, token, next_position = rows[live], slots[live], token[live], next_position[live]
            cache, slots = compacted(static, cache, slots)
        feed, at = slot_inputs(cache, slots, token[:, None], next_position[:, None], params.pad_token_id)
        (all_logits,) = static.step(cache, "sample", forward, feed, at, ladder=(1,))  # (S, V)
        logits = all_logits[slots]  # (R, V)
        kept = torch.zeros(cache.slots, dtype=torch.long, device=device)
        kept[slots] = 1
        cache.commit(kept)
        next_position = next_position + 1

    return generation_of(out_ids, out_logp, lengths.tolist(), stopped)
