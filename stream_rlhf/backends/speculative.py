"""Lossless speculative rollout with Medusa heads: `torch_rollout.generate`, several tokens per backbone forward.

    heads = load_heads(folder)          # or MedusaHeads.from_policy(policy, num_heads=3), then trained
    gen, stats = generate_speculative(model, heads, prompts, params, generator=torch.Generator().manual_seed(0))
    gen.response_ids[i], gen.response_logp[i], gen.finish_reasons[i]; stats.mean_accept_len

Same contract as `generate` for text models (left-padded batch, stop tokens end and are included in a
response, `max_new_tokens`, the same finish reasons and behaviour log-probs), and the same
distribution of responses at any temperature and top_p; with temperature 0 the same tokens (up to
float rounding: the K+1-token verification forward may differ from one-token forwards in the last
bits, which only matters at an exact argmax tie). The backbone is run as its decoder
(`get_decoder()`) and LM head (`get_output_embeddings()`), as `sequence_logprobs` runs it, so a
row's last hidden state is at hand for the heads. Tests: tests/test_speculative.py.

One step, per row (all rows step together; K = heads.num_heads, fewer on the last steps if fewer
tokens are left to generate). State: the KV cache up to position t, the pending token y at t+1
(already sampled from the backbone and emitted, not yet in the cache) and h_t, the backbone's last
hidden state at t (after the final norm: what the LM head reads).
    1. draft   d_k ~ q_k for k = 1..K, q_k = the sampling transform (temperature, top-p) of head k-1 at
               h_t (Medusa head k-1 predicts position t+1+k); d_k are drawn independently.
    2. verify  ONE backbone forward over [y, d_1..d_K] at positions t+1..t+K+1 gives p_1..p_{K+1},
               p_j the backbone's sampling distribution of position t+1+j (p_{K+1}: the "bonus").
    3. accept  d_k with probability min(1, p_k(d_k) / q_k(d_k)) while d_1..d_{k-1} were accepted: n.
    4. z ~ normalize(max(0, p_{n+1} - q_{n+1})) if n < K, else z ~ p_{K+1}.
    5. emit d_1..d_n, z (cut after a stop token or at max_new_tokens); y, d_1..d_n stay in the cache,
       z is the new pending token and h = the hidden state at d_n (at y when n = 0).
Greedy (temperature 0): d_k = argmax of head k-1, accepted iff d_k == argmax p_k; z = argmax p_{n+1}.
Why exact (Leviathan et al. 2023, Chen et al. 2023): given the tokens before it, the first undecided
position gets x by acceptance with probability q(x) min(1, p(x)/q(x)) = min(p, q)(x), and by
replacement with probability (1 - sum min(p, q)) (p - q)+(x) / sum (p - q)+ = (p - q)+(x); the sum
is p(x). Each head's draft is a proposal independent of the other drafts, so the argument holds at
every position in turn: every token is drawn from p given the tokens before it, as in plain decoding.

KV-cache rollback (one DynamicCache for the batch): every step appends K+1 slots to every row. The 2D
attention mask marks the slots a row rejected (after its n accepted drafts; all of them for a row
that has finished) with 0, so no later query attends to them: a row's cache is its kept tokens with
holes. Position ids are tracked per row (the next position = how many tokens the row has kept), so
positions stay contiguous and each row sees exactly what plain decoding would. Slots rejected by every
row at the tail are cropped (`DynamicCache.crop`), so the cache grows by max over rows of (n + 1) per
step. Only the K+1 new queries are computed per step; the holes cost attention width, nothing else.
A row that has finished leaves the batch (its cache rows too, `batch_select_indices`), so the steps
that only a few slow rows still need cost in proportion to those rows.

Behaviour log-probs: of each emitted token under the backbone's FULL tempered distribution
softmax(logits / temperature) at its position (not top-p-truncated, not the heads'), through
`logprobs_from_logits`, exactly as `generate` records them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from stream_rlhf.backends.kv_cache import PreallocatedCache, cache_argument
from stream_rlhf.backends.torch_rollout import (
    Generation,
    SamplingParams,
    generation_of,
    left_pad,
    sample_tokens,
    sampling_probs,
)
from stream_rlhf.kernels.logprob import logprobs_from_logits
from stream_rlhf.models.medusa import MedusaHeads


@dataclass
class SpeculationStats:
    """Counters of one `generate_speculative` call. A "row step" is one row taking part in one
    verification forward while it has not finished."""

    num_heads: int
    """K: drafts proposed per row step (fewer on the last steps, when fewer tokens are left)."""
    verify_steps: int = 0
    """Backbone forwards after the prefill (each verifies every unfinished row at once)."""
    row_steps: int = 0
    """Sum over verification steps of the number of unfinished rows."""
    tokens: int = 0
    """Response tokens emitted, all rows (the prefill's first token of each row included)."""
    drafts_proposed: int = 0
    """Drafts fed to verification, summed over row steps."""
    drafts_accepted: int = 0
    """Drafts accepted by verification, summed over row steps (before the cut at a stop token or at
    max_new_tokens, which may emit fewer)."""

    @property
    def mean_accept_len(self) -> float:
        """Tokens each verification produced per row step, (accepted drafts + 1) on average: 1 when
        no draft is ever accepted, K + 1 when all are. 1.0 when there was no row step."""
        return 1.0 + self.drafts_accepted / self.row_steps if self.row_steps else 1.0

    @property
    def acceptance_rate(self) -> float:
        """drafts_accepted / drafts_proposed (0.0 when none was proposed)."""
        return self.drafts_accepted / self.drafts_proposed if self.drafts_proposed else 0.0


def _check_heads(model: nn.Module, heads: MedusaHeads) -> None:
    vocab_size, hidden_size = model.get_output_embeddings().weight.shape
    if (heads.vocab_size, heads.hidden_size) != (vocab_size, hidden_size):
        raise ValueError(
            f"heads: vocab_size={heads.vocab_size}, hidden_size={heads.hidden_size}: must match the model's "
            f"LM head (vocab_size={vocab_size}, hidden_size={hidden_size})"
        )


def _draft(
    heads: MedusaHeads, hidden: Tensor, k: int, params: SamplingParams, generator: torch.Generator | None
) -> tuple[Tensor, Tensor | None]:
    """Drafts (B, k) from the first k heads at hidden (B, H), and their sampling distributions
    q (B, k, V) (None when greedy). k = 0: no draft, plain decoding."""
    if k == 0:
        empty = hidden.new_zeros((hidden.shape[0], 0, heads.vocab_size), dtype=torch.float32)  # (B, 0, V)
        return empty[..., 0].long(), None if params.temperature == 0 else empty
    head_logits = heads(hidden)[:k].transpose(0, 1).float()  # (B, k, V)
    if params.temperature == 0:
        return head_logits.argmax(-1), None
    q = sampling_probs(head_logits, params)  # (B, k, V)
    drafts = torch.multinomial(q.flatten(0, 1), 1, generator=generator).view(q.shape[:2])  # (B, k)
    return drafts, q


def _verify(
    logits: Tensor, drafts: Tensor, q: Tensor | None, params: SamplingParams, generator: torch.Generator | None
) -> tuple[Tensor, Tensor]:
    """Accepted drafts per row n (B,) and the next token z (B,): the replacement at the first
    rejection or the bonus. logits (B, k+1, V) of the backbone, drafts (B, k), q (B, k, V)."""
    batch, k = drafts.shape
    rows = torch.arange(batch, device=logits.device)
    if params.temperature == 0:
        target = logits.argmax(-1)  # (B, k+1)
        n = (drafts == target[:, :k]).long().cumprod(-1).sum(-1)  # (B,)
        return n, target[rows, n]
    p = sampling_probs(logits, params)  # (B, k+1, V)
    p_draft = p[:, :k].gather(-1, drafts[..., None]).squeeze(-1)  # (B, k)
    q_draft = q.gather(-1, drafts[..., None]).squeeze(-1)  # (B, k), > 0: the drafts were drawn from q
    u = torch.rand((batch, k), generator=generator, device=logits.device)  # (B, k)
    n = (u * q_draft < p_draft).long().cumprod(-1).sum(-1)  # (B,) accepted with prob min(1, p/q)
    p_next = p[rows, n]  # (B, V)
    q_next = torch.cat([q, q.new_zeros((batch, 1, q.shape[-1]))], dim=1)[rows, n]  # (B, V), 0 for the bonus
    residual = (p_next - q_next).clamp_(min=0)  # (B, V)
    # (p - q)+ vanishes only where p == q up to rounding, when a rejection has probability ~0: use p
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_next)
    return n, torch.multinomial(residual, 1, generator=generator).squeeze(-1)


def emit_accepted(
    logits: Tensor, drafts: Tensor, n: Tensor, z: Tensor, temperature: float, stop_ids: Tensor, n_tokens: Tensor,
    rows: Tensor, out_ids: Tensor, out_logp: Tensor,
) -> tuple[Tensor, Tensor]:
    """Write one verify step's tokens into the (B, max_new + 1) buffers (the last column takes the
    writes that are cut): each row's n accepted drafts and
    z, cut after a stop token and at the length limit. logits (R, k+1, V), drafts (R, k), n and z (R,),
    n_tokens (R,) tokens each row has so far, rows (R,) its row in the buffers. Returns how many
    tokens each row keeps (R,) and whether it stopped on a stop token (R,)."""
    k, max_new = drafts.shape[1], out_ids.shape[1] - 1
    offsets = torch.arange(k + 1, device=logits.device)  # (k+1,)
    emitted = torch.cat([drafts, z[:, None]], dim=1).scatter(1, n[:, None], z[:, None])  # (R, k+1)
    emitted_logp = logprobs_from_logits(logits, emitted, temperature)[0]  # (R, k+1)
    is_stop = (offsets <= n[:, None]) & torch.isin(emitted, stop_ids)  # (R, k+1)
    first_stop = torch.where(is_stop.any(1), is_stop.long().argmax(1), k + 1)  # (R,)
    keep = torch.minimum(torch.minimum(n, first_stop) + 1, max_new - n_tokens)  # (R,)
    columns = torch.where(offsets < keep[:, None], n_tokens[:, None] + offsets, max_new)  # (R, k+1)
    out_ids[rows[:, None], columns] = emitted
    out_logp[rows[:, None], columns] = emitted_logp
    return keep, first_stop < keep


@torch.inference_mode()
def generate_speculative(
    model: nn.Module,
    heads: MedusaHeads,
    prompts: list[Tensor],
    params: SamplingParams,
    generator: torch.Generator | None = None,
) -> tuple[Generation, SpeculationStats]:
    """Sample one response per prompt (P_i,) as `generate` does, drafting with `heads`; `generator`
    must live on the model's device."""
    stats = SpeculationStats(num_heads=heads.num_heads)
    if not prompts:
        return Generation([], [], []), stats
    if min(p.numel() for p in prompts) < 1:
        raise ValueError("prompts: every prompt must have at least one token")
    _check_heads(model, heads)
    decoder, lm_head = model.get_decoder(), model.get_output_embeddings()
    device = lm_head.weight.device
    batch, max_new, temperature = len(prompts), params.max_new_tokens, params.temperature
    input_ids, attention = left_pad(prompts, params.pad_token_id, device)  # (B, P), (B, P)
    position_ids = (attention.cumsum(-1) - 1).clamp(min=0)  # (B, P)
    stop_ids = torch.tensor(params.stop_token_ids, dtype=torch.long, device=device)
    cache = PreallocatedCache(input_ids.shape[1] + max_new + heads.num_heads + 1)
    run = {**cache_argument(decoder, cache), "use_cache": True}
    hidden = decoder(input_ids=input_ids, attention_mask=attention, position_ids=position_ids, **run)
    hidden = hidden.last_hidden_state[:, -1]  # (B, H): the last prompt token of every row
    logits = lm_head(hidden).float()  # (B, V)
    pending = sample_tokens(logits, params, generator)  # (B,) emitted, not yet in the cache

    # responses, by prompt: column max_new is a dump for the writes that are cut
    out_ids = torch.full((batch, max_new + 1), params.pad_token_id, dtype=torch.long, device=device)
    out_logp = torch.zeros((batch, max_new + 1), device=device)
    out_ids[:, 0] = pending
    out_logp[:, 0] = logprobs_from_logits(logits, pending, temperature)[0]
    lengths = torch.ones(batch, dtype=torch.long, device=device)  # (B,) by prompt, final once a row leaves
    stopped_by_prompt = torch.zeros(batch, dtype=torch.bool, device=device)  # (B,)
    # the working batch: the rows that have not finished (R <= B), rows[r] their prompt
    rows = torch.arange(batch, device=device)  # (R,)
    n_tokens = lengths.clone()  # (R,) response length so far
    stopped = torch.isin(pending, stop_ids)  # (R,)
    finished = stopped | (n_tokens >= max_new)  # (R,)
    next_position = position_ids[:, -1] + 1  # (R,) position of the pending token
    accepted = torch.zeros((), dtype=torch.long, device=device)  # drafts accepted so far
    appended, kept_slots = 0, torch.zeros(batch, dtype=torch.long, device=device)  # by the last step

    while True:
        active = ~finished
        left = (max_new - n_tokens).masked_fill(finished, 0)  # (R,) tokens each row may still emit
        n_active, most_left, most_kept = torch.stack([active.sum(), left.max(), kept_slots.max()]).tolist()
        if appended > most_kept:  # the last step's trailing slots that no row kept
            cache.crop(most_kept - appended)
            attention = attention[:, : most_kept - appended]
        if n_active < len(rows):  # finished rows leave the working batch with their results
            lengths[rows], stopped_by_prompt[rows] = n_tokens, stopped
            if n_active == 0:
                break
            (live,) = active.nonzero(as_tuple=True)  # (R',)
            cache.batch_select_indices(live)
            rows, attention, hidden, pending = rows[live], attention[live], hidden[live], pending[live]
            n_tokens, stopped, next_position = n_tokens[live], stopped[live], next_position[live]
        k = min(heads.num_heads, most_left - 1)  # a step emits at most k + 1 tokens
        slots = torch.arange(k + 1, device=device)  # (k+1,)
        drafts, q = _draft(heads, hidden, k, params, generator)  # (R, k), (R, k, V) | None
        feed = torch.cat([pending[:, None], drafts], dim=1)  # (R, k+1)
        attention = torch.cat([attention, torch.ones_like(feed)], dim=1)  # (R, S + k+1)
        out = decoder(
            input_ids=feed, attention_mask=attention, position_ids=next_position[:, None] + slots, **run
        ).last_hidden_state  # (R, k+1, H)
        logits = lm_head(out).float()  # (R, k+1, V): logits[:, j] is the distribution of feed[:, j + 1]
        n, z = _verify(logits, drafts, q, params, generator)  # (R,), (R,)

        keep, stops = emit_accepted(logits, drafts, n, z, temperature, stop_ids, n_tokens, rows, out_ids, out_logp)
        stopped |= stops
        n_tokens += keep
        finished = stopped | (n_tokens >= max_new)

        stats.verify_steps += 1
        stats.row_steps += n_active
        stats.drafts_proposed += k * n_active
        accepted += n.sum()

        # rows keep y, d_1..d_n (finished rows nothing): mask the rest; the next iteration crops the
        # trailing slots no row kept
        appended, kept_slots = k + 1, (n + 1).masked_fill(finished, 0)  # (R,)
        attention[:, -appended:] = (slots < kept_slots[:, None]).long()
        hidden = out[torch.arange(len(rows), device=device), n]  # (R, H): at d_n, or at y when n = 0
        next_position = next_position + n + 1
        pending = z

    lengths_list = lengths.tolist()
    stats.tokens, stats.drafts_accepted = sum(lengths_list), int(accepted)
    return generation_of(out_ids, out_logp, lengths_list, stopped_by_prompt), stats
