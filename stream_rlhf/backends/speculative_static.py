"""Medusa's draft-and-verify over a static slot cache (`static_decode.py`): `generate_speculative`'s
contract and, for the same generator, its tokens.

    gen, stats = generate_speculative_static(model, heads, static, prompts, params, generator)

The steps are `speculative.py`'s (draft from the heads, verify with one backbone forward over the
pending token and K drafts, accept, replace or take the bonus) on the live rows, in prompt order,
with the same draws from the generator. What changes is the cache: the verification forward runs
over every slot of the bucket (a CUDA graph per bucket and K on CUDA; K only drops on the last
steps), and a row keeps its y, d_1..d_n by `commit(n + 1)`: the next step writes over the
positions it rejected, so the cache has no holes and nothing is cropped.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from stream_rlhf.backends.kv_cache import cache_argument
from stream_rlhf.backends.slot_cache import SlotCache
from stream_rlhf.backends.speculative import SpeculationStats, _check_heads, _draft, _verify, emit_accepted
from stream_rlhf.backends.static_decode import StaticDecoder, StepForward
from stream_rlhf.backends.static_sampler import compacted, prefill_into, slot_inputs
from stream_rlhf.backends.torch_rollout import Generation, SamplingParams, generation_of, sample_tokens
from stream_rlhf.kernels.logprob import logprobs_from_logits
from stream_rlhf.models.medusa import MedusaHeads


def _verify_forward(model: nn.Module) -> StepForward:
    decoder, lm_head = model.get_decoder(), model.get_output_embeddings()

    def forward(cache: SlotCache, tokens: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        mask = cache.begin(tokens.shape[1])  # (S, 1, k+1, C)
        hidden = decoder(input_ids=tokens, attention_mask=mask, position_ids=positions,
                         **cache_argument(decoder, cache), use_cache=True).last_hidden_state  # (S, k+1, H)
        return hidden, lm_head(hidden).float()  # (S, k+1, H), (S, k+1, V)

    return forward


@torch.inference_mode()
def generate_speculative_static(
    model: nn.Module,
    heads: MedusaHeads,
    static: StaticDecoder,
    prompts: list[Tensor],
    params: SamplingParams,
    generator: torch.Generator | None = None,
) -> tuple[Generation, SpeculationStats]:
    """Sample one response per prompt (P_i,) as `generate_speculative` does, over `static`'s caches."""
    stats = SpeculationStats(num_heads=heads.num_heads)
    if not prompts:
        return Generation([], [], []), stats
    if min(p.numel() for p in prompts) < 1:
        raise ValueError("prompts: every prompt must have at least one token")
    _check_heads(model, heads)
    lm_head = model.get_output_embeddings()
    device = lm_head.weight.device
    batch, max_new, temperature = len(prompts), params.max_new_tokens, params.temperature
    # a finished slot may still be written K + 1 positions past its last one (never read)
    cache, hidden, _, next_position = prefill_into(static, model.get_decoder(), prompts, params,
                                                   heads.num_heads + 1, share_prompts=False)
    logits = lm_head(hidden).float()  # (B, V)
    pending = sample_tokens(logits, params, generator)  # (B,) emitted, not yet in the cache
    stop_ids = torch.tensor(params.stop_token_ids, dtype=torch.long, device=device)
    forward = _verify_forward(model)
    lengths = tuple(range(1, heads.num_heads + 2))  # k + 1 tokens a step; k drops on the last steps

    # responses, by prompt: column max_new is a dump for the writes that are cut
    out_ids = torch.full((batch, max_new + 1), params.pad_token_id, dtype=torch.long, device=device)
    out_logp = torch.zeros((batch, max_new + 1), device=device)
    out_ids[:, 0] = pending
    out_logp[:, 0] = logprobs_from_logits(logits, pending, temperature)[0]
    lengths = torch.ones(batch, dtype=torch.long, device=device)  # (B,) by prompt, final once a row leaves
    stopped_by_prompt = torch.zeros(batch, dtype=torch.bool, device=device)  # (B,)
    rows = torch.arange(batch, device=device)  # (R,) the rows that have not finished: their prompts
    slots = rows.clone()  # (R,) and their slots
    n_tokens = lengths.clone()  # (R,) response length so far
    stopped = torch.isin(pending, stop_ids)  # (R,)
    finished = stopped | (n_tokens >= max_new)  # (R,)
    accepted = torch.zeros((), dtype=torch.long, device=device)  # drafts accepted so far

    while True:
        active = ~finished
        left = (max_new - n_tokens).masked_fill(finished, 0)  # (R,) tokens each row may still emit
        n_active, most_left = torch.stack([active.sum(), left.max()]).tolist()
        if n_active < len(rows):  # finished rows leave with their results; their slots get pad
            lengths[rows], stopped_by_prompt[rows] = n_tokens, stopped
            if n_active == 0:
                break
            (live,) = active.nonzero(as_tuple=True)  # (R',)
            rows, slots, hidden, pending = rows[live], slots[live], hidden[live], pending[live]
            n_tokens, stopped, next_position = n_tokens[live], stopped[live], next_position[live]
            cache, slots = compacted(static, cache, slots)
        k = min(heads.num_heads, most_left - 1)  # a step emits at most k + 1 tokens
        offsets = torch.arange(k + 1, device=device)  # (k+1,)
        drafts, q = _draft(heads, hidden, k, params, generator)  # (R, k), (R, k, V) | None
        feed, at = slot_inputs(cache, slots, torch.cat([pending[:, None], drafts], dim=1),
                               next_position[:, None] + offsets, params.pad_token_id)  # (S, k+1)
        all_hidden, all_logits = static.step(cache, "verify", forward, feed, at, ladder=lengths)
        out, logits = all_hidden[slots], all_logits[slots]  # (R, k+1, H), (R, k+1, V)
        n, z = _verify(logits, drafts, q, params, generator)  # (R,), (R,)

        keep, stops = emit_accepted(logits, drafts, n, z, temperature, stop_ids, n_tokens, rows, out_ids, out_logp)
        stopped |= stops
        n_tokens += keep
        finished = stopped | (n_tokens >= max_new)

        stats.verify_steps += 1
        stats.row_steps += n_active
        stats.drafts_proposed += k * n_active
        accepted += n.sum()

        kept = torch.zeros(cache.slots, dtype=torch.long, device=device)  # y, d_1..d_n; nothing once finished
        kept[slots] = (n + 1).masked_fill(finished, 0)
        cache.commit(kept)
        hidden = out[torch.arange(len(rows), device=device), n]  # (R, H): at d_n, or at y when n = 0
        next_position = next_position + n + 1
        pending = z

    lengths_list = lengths.tolist()
    stats.tokens, stats.drafts_accepted = sum(lengths_list), int(accepted)
    return generation_of(out_ids, out_logp, lengths_list, stopped_by_prompt), stats

