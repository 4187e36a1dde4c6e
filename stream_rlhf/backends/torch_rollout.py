"""Batched sampling with a KV cache over a Hugging Face causal LM: the plain-torch rollout backend.

    params = SamplingParams(temperature=0.7, top_p=0.95, max_new_tokens=64, stop_token_ids=(eos,))
    gen = generate(model, prompts, params, generator=torch.Generator().manual_seed(0))
    gen.response_ids[i], gen.response_logp[i], gen.finish_reasons[i]
    load_weights(model, named, "rollout-0")      # a policy version received between generates

Prompts are left-padded into one batch; position ids come from the attention mask, so padding does
not shift positions and each row decodes exactly as it would alone. One prefill, then one token
per step for every row through a KV cache written in place (`kv_cache.py`); a row that samples a
stop token leaves the batch (its cache rows too), so the last steps cost only the rows still
decoding. A text prompt that comes several times (the samples of one prompt) is prefilled once,
and its cache rows copied.

Behaviour log-probs: the recorded log-prob of each sampled token is taken under the FULL tempered
distribution softmax(logits / temperature), not the top-p-truncated one that was sampled from, so
it equals what a later forward pass recomputes with `sequence_logprobs(..., temperature)`
(both go through `stream_rlhf.kernels.logprob`).
With temperature 0 (greedy) it is the log-prob under the untempered distribution.

Vision-language models (`images=`, one `SampleImages` per prompt): the prefill runs the language
model on left-padded `inputs_embeds` (the precomputed image features at the image tokens, with
Qwen3-VL's deepstack features for its first layers) and left-padded M-RoPE
positions (3, B, P); each row's decode steps continue at (its largest prompt position + 1), +1 per
step, on all three axes, as Hugging Face's `rope_deltas` do. The image token itself is never
sampled (its logit is masked for sampling only; the behaviour log-probs still use the full
distribution): an image token in a response would have no features in every later forward.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from stream_rlhf.backends.keyed_draws import inverse_cdf
from stream_rlhf.backends.kv_cache import PreallocatedCache, cache_argument
from stream_rlhf.kernels.logprob import logprobs_from_logits
from stream_rlhf.models.vision_language import check_sample_images, language_model_inputs, mrope_positions
from stream_rlhf.samples import SampleImages


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
    stop_strings: tuple[str, ...] = ()
    """Text that ends a multi-turn episode's policy turn at the token completing it (finish reason
    "stop"; `env.stop_strings`): read by the turn samplers (`backends/turn_stop.py`, vLLM's `stop`)."""

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
        if not isinstance(self.stop_strings, tuple) or not all(isinstance(s, str) and s for s in self.stop_strings):
            raise ValueError(f"stop_strings={self.stop_strings!r}: must be a tuple of non-empty strings")


@dataclass
class Generation:
    """One response per prompt, in prompt order; tensors on the CPU."""

    response_ids: list[Tensor]
    """(R_i,) long; includes the stop token when one was sampled."""
    response_logp: list[Tensor]
    """(R_i,) fp32 behaviour log-prob of each response token (full tempered distribution)."""
    finish_reasons: list[str]
    """Either "stop" (a stop token was sampled) or "length" (max_new_tokens reached)."""


def sampling_probs(logits: Tensor, params: SamplingParams) -> Tensor:
    """The distribution `sample_tokens` draws from at temperature > 0: softmax(logits / temperature),
    top-p-truncated and renormalised. (..., V) -> (..., V) fp32."""
    probs = torch.softmax(logits.float() / params.temperature, dim=-1)  # (..., V)
    if params.top_p < 1:
        sorted_probs, order = probs.sort(dim=-1, descending=True, stable=True)  # (..., V)
        # drop a token once the mass before it already reaches top_p; the most likely one stays
        drop = sorted_probs.cumsum(-1) - sorted_probs >= params.top_p  # (..., V)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs.masked_fill(drop, 0.0))
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample_tokens(logits: Tensor, params: SamplingParams, generator: torch.Generator | None,
                  uniforms: Tensor | None = None) -> Tensor:
    """Next token per row from logits (B, V) -> (B,): argmax, or top-p sampling at temperature,
    drawn from `generator`, or with `uniforms` (B,) in [0, 1) one number per row (`keyed_draws.py`)."""
    if params.temperature == 0:
        return logits.argmax(-1)
    probs = sampling_probs(logits, params)
    if uniforms is not None:
        return inverse_cdf(probs, uniforms)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def left_pad(prompts: list[Tensor], pad_token_id: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """Prompts (P_i,) -> input_ids (B, P) and attention mask (B, P) long, padding on the left."""
    width = max(p.numel() for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long, device=device)
    attention = torch.zeros((len(prompts), width), dtype=torch.long, device=device)
    for i, prompt in enumerate(prompts):
        input_ids[i, width - prompt.numel() :] = prompt.to(device)
        attention[i, width - prompt.numel() :] = 1
    return input_ids, attention


def distinct_prompts(prompts: list[Tensor]) -> tuple[list[Tensor], Tensor | None]:
    """The distinct prompts, in first-seen order, and for each input prompt the index of its
    distinct one (B,); (prompts, None) when every prompt is distinct."""
    index_of: dict[tuple[int, ...], int] = {}
    distinct: list[Tensor] = []
    copies = []
    for prompt in prompts:
        key = tuple(prompt.tolist())
        if key not in index_of:
            index_of[key] = len(distinct)
            distinct.append(prompt)
        copies.append(index_of[key])
    if len(distinct) == len(prompts):
        return prompts, None
    return distinct, torch.tensor(copies, dtype=torch.long, device=prompts[0].device)


def _image_prefill(
    model: nn.Module, prompts: list[Tensor], images: list[SampleImages], input_ids: Tensor, attention: Tensor
) -> tuple[dict[str, Tensor], Tensor]:
    """Prefill inputs of left-padded prompts for the language model (`language_model_inputs`:
    inputs_embeds (B, P, H), Qwen3-VL's deepstack features; M-RoPE position_ids (3, B, P)), and
    each row's first decode position (B, 1): its largest prompt position + 1."""
    if len(images) != len(prompts):
        raise ValueError(f"images: {len(images)} entries for {len(prompts)} prompts: must be one per prompt")
    config = model.config
    batch, width = input_ids.shape
    position_ids = torch.zeros((3, batch, width), dtype=torch.long)  # (3, B, P), 0 on padding
    for i, (prompt, sample) in enumerate(zip(prompts, images)):
        check_sample_images(i, prompt, sample, config)
        position_ids[:, i, width - prompt.numel() :] = mrope_positions(prompt.cpu(), sample.grid_thw, config)
    if bool(((input_ids == config.image_token_id) & (attention == 0)).any()):
        raise ValueError(f"pad_token_id={config.image_token_id}: must not be the image token")
    features = torch.cat([sample.features for sample in images]).to(input_ids.device)  # (N, W), prompt order
    inputs = language_model_inputs(model, input_ids, features)
    next_position = position_ids.amax(dim=(0, 2))[:, None] + 1  # (B, 1)
    device = input_ids.device
    return {**inputs, "position_ids": position_ids.to(device)}, next_position.to(device)


@torch.inference_mode()
def generate(
    model: nn.Module,
    prompts: list[Tensor],
    params: SamplingParams,
    generator: torch.Generator | None = None,
    images: list[SampleImages] | None = None,
) -> Generation:
    """Sample one response per prompt (P_i,); `generator` must live on the model's device.

    `images`: one `SampleImages` per prompt for a vision-language model (None: a text model).
    """
    if not prompts:
        return Generation([], [], [])
    if min(p.numel() for p in prompts) < 1:
        raise ValueError("prompts: every prompt must have at least one token")
    device = next(model.parameters()).device
    # a text prompt sampled several times (GRPO's groups) is prefilled once; its cache rows are copied
    distinct, copies = distinct_prompts(prompts) if images is None else (prompts, None)
    input_ids, attention = left_pad(distinct, params.pad_token_id, device)  # (U, P), (U, P)
    banned: int | None = None  # a token never sampled
    if images is None:
        position_ids = (attention.cumsum(-1) - 1).clamp(min=0)  # (B, P)
        prefill = {"input_ids": input_ids, "position_ids": position_ids}
        next_position = position_ids[:, -1:] + 1  # (B, 1)
    else:
        prefill, next_position = _image_prefill(model, prompts, images, input_ids, attention)
        banned = model.config.image_token_id
    stop_ids = torch.tensor(params.stop_token_ids, dtype=torch.long, device=device)
    cache = PreallocatedCache(input_ids.shape[1] + params.max_new_tokens)
    run = {**cache_argument(model, cache), "use_cache": True}
    if images is None:
        logits = model(**prefill, attention_mask=attention, **run, logits_to_keep=1).logits[:, -1].float()  # (U, V)
    else:  # through the language model, which takes Qwen3-VL's deepstack features (the VLM's forward does not)
        decoder = model.get_decoder()
        hidden = decoder(**prefill, attention_mask=attention, **cache_argument(decoder, cache), use_cache=True)
        logits = model.get_output_embeddings()(hidden.last_hidden_state[:, -1]).float()  # (U, V)
    if copies is not None:  # one row per prompt from here on
        cache.batch_select_indices(copies)
        logits, attention, next_position = logits[copies], attention[copies], next_position[copies]

    batch, max_new = len(prompts), params.max_new_tokens
    out_ids = torch.full((batch, max_new), params.pad_token_id, dtype=torch.long, device=device)  # by prompt
    out_logp = torch.zeros((batch, max_new), device=device)
    lengths = torch.full((batch,), max_new, dtype=torch.long, device=device)  # final once a row leaves
    stopped = torch.zeros(batch, dtype=torch.bool, device=device)
    rows = torch.arange(batch, device=device)  # (R,) the prompts of the rows still decoding
    for step in range(max_new):  # logits: (R, V)
        token, stop = sample_into(logits, params, generator, stop_ids, out_ids, out_logp, rows, step, banned)
        if step == max_new - 1:
            stopped[rows] = stop
            break
        if bool(stop.any()):  # rows that sampled a stop token leave the batch, with their cache rows
            lengths[rows[stop]], stopped[rows[stop]] = step + 1, True
            (live,) = stop.logical_not().nonzero(as_tuple=True)  # (R',)
            if len(live) == 0:
                break
            cache.batch_select_indices(live)
            rows, token, attention, next_position = rows[live], token[live], attention[live], next_position[live]
        attention = torch.cat([attention, torch.ones_like(attention[:, :1])], dim=1)  # (R, P + step + 1)
        # (R, 1) for a text model, (3, R, 1) M-RoPE positions with images
        step_positions = next_position if images is None else next_position[None].expand(3, -1, -1)
        logits = model(
            token[:, None], attention_mask=attention, position_ids=step_positions, **run
        ).logits[:, -1].float()
        next_position = next_position + 1

    return generation_of(out_ids, out_logp, lengths.tolist(), stopped)


def sample_into(logits: Tensor, params: SamplingParams, generator: torch.Generator | None, stop_ids: Tensor,
                out_ids: Tensor, out_logp: Tensor, rows: Tensor, step: int,
                banned: int | None = None, uniforms: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Sample one token per decoding row from logits (R, V) (never `banned`; from `generator`, or
    with one of `uniforms` (R,) each: `sample_tokens`), write it and its log-prob at column `step`
    of rows `rows` of the (B, max_new) buffers; the tokens (R,) and whether each is a stop token (R,)."""
    if banned is not None:
        allowed = logits.index_fill(-1, torch.tensor([banned], device=logits.device), -math.inf)
    else:
        allowed = logits
    token = sample_tokens(allowed, params, generator, uniforms)  # (R,)
    out_ids[rows, step] = token
    out_logp[rows, step] = logprobs_from_logits(logits, token, params.temperature)[0]
    return token, torch.isin(token, stop_ids)


def generation_of(out_ids: Tensor, out_logp: Tensor, lengths: list[int], stopped: Tensor) -> Generation:
    """The Generation held in (B, max_new) token and log-prob buffers: row i's first lengths[i]
    entries, finished by a stop token where `stopped` (B,), else by the length limit."""
    out_ids, out_logp = out_ids.cpu(), out_logp.cpu()
    return Generation(
        response_ids=[out_ids[i, :n].clone() for i, n in enumerate(lengths)],
        response_logp=[out_logp[i, :n].clone() for i, n in enumerate(lengths)],
        finish_reasons=["stop" if s else "length" for s in stopped.tolist()],
    )


def load_weights(model: nn.Module, named: Iterable[tuple[str, Tensor]], who: str) -> None:
    """Copy a received policy version (`weights/transport.py`: all of the model's tensors, or only
    its trained ones) into `model` in place; a name the model lacks is an error naming `who`."""
    result = model.load_state_dict(dict(named), strict=False)
    if result.unexpected_keys:
        raise ValueError(f"{who}: received weights the model does not have: {result.unexpected_keys[:5]}")
