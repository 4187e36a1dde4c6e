"""The torch engine's TurnSampler (`envs/turns.py`): the policy turns of a mini-batch's multi-turn
episodes, decoded together while each episode joins and leaves the batch at its turn boundaries.

    sampler = TorchTurnSampler(model, slots=64, capacity=512, params=params,
                               seed_parts=rollout_seed(seed, iteration, minibatch), policy_version=7)
    sampler.start(TurnRequest(key=3, context=ids, images=None, max_new_tokens=32))
    done = sampler.advance()     # one step: at most one sampled token per episode; the turns that ended
    sampler.release(3)

Each episode owns a row of one `SlotCache` for its lifetime: the row keeps the KV of every id the
episode has fed, so a turn feeds only the ids its row has not seen: its whole prompt on the first
turn, then the previous turn's last sampled token (sampled, never fed) and the observation. The
episodes in a turn hold the first rows (an episode's row trades places with another's, KV and all,
when its turn starts or ends: `SlotCache.swap`), and an eager step covers only those rows, so the
episodes waiting for their tools cost nothing. `advance` runs ONE step: each episode in a turn feeds
its next ids (a decoding one its last token; a joining one up to the step's width Q of its new ids,
right-padded: a row commits only its real positions), then one token is sampled for every episode
that has fed all it had, in key order (`torch_rollout.sample_into`). Each turn draws from a stream
of its own: its seed is the one vLLM's request for it gets (`seeding.TurnSeeds`: the episode's name
and the turn's index), and its k-th token reads that stream's k-th number (`keyed_draws.py`), so an
episode samples the same tokens whatever its slot, the episodes beside it and when their tools
answer. An episode that samples a stop token (or a token that completes one of the params'
`stop_strings`: `turn_stop.py`) or its turn's `max_new_tokens`th token ends its turn (a `TurnDone`)
and feeds nothing until its next turn starts; the others decode on. (With a `StaticDecoder` an
episode's row is its key and a step covers every row: a waiting episode's is padding, written past
and never read.)

Every row of a step computes Q positions, so Q is chosen per step (`step_width`): the widest at
which padding is at most half the step, or which fits `free_positions` (a GPU's one-token step
costs about the same). One episode joining with a long observation beside many decoding ones thus
feeds it a few ids per step (its first token comes some steps later) instead of making every row
compute its length; episodes joining together (the first turns) feed their prompts in one step.

Positions: a text episode's ids sit at 0, 1, 2, ... (its context index); a vision-language
episode's fed ids take the M-RoPE positions of its whole context (`mrope_positions`: images as
grids), and each decoded token (max + 1), +1 per token on all three axes, as `generate` does; the
image features of the fed image tokens come from the request's `images` (the episode's images so
far: an observation that shows an image brings its features in the next turn's request, and its
image run takes its grid positions after the text before it). The image token is never sampled.
So a behaviour log-prob equals what a full forward of the finished episode recomputes.

With a `StaticDecoder` (text models), the cache is its bucket's and the one-token steps are its
CUDA graphs; steps of several positions (turns joining) run eagerly over the same buffers.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import Tensor, nn

from stream_rlhf.backends.keyed_draws import keyed_uniforms
from stream_rlhf.backends.kv_cache import PreallocatedCache, cache_argument
from stream_rlhf.backends.slot_cache import SlotCache
from stream_rlhf.backends.static_decode import StaticDecoder, has_sliding_layers
from stream_rlhf.backends.torch_rollout import SamplingParams, sample_into
from stream_rlhf.backends.turn_stop import TurnStop
from stream_rlhf.envs.turns import TurnDone, TurnRequest
from stream_rlhf.models.vision_language import (
    check_sample_images,
    is_vision_language_model,
    language_model_inputs,
    mrope_positions,
)
from stream_rlhf.samples import SampleImages
from stream_rlhf.seeding import TurnSeeds

WASTE = 2
"""A step computes at most this many positions per id it feeds (`step_width`), unless it is free."""
CUDA_FREE_POSITIONS = 1024
"""`free_positions` on a GPU, where a step of 64 slots x 16 positions is latency-bound like a
one-token step (an estimate, not measured here); 0 on the CPU, where every position costs."""


@dataclass
class _Episode:
    """What the sampler holds for one episode (its cache row: `TorchTurnSampler.row_of`)."""

    ids: list[int]
    """Every id of the episode so far; the first `fed` are in its row, the rest wait to be fed."""
    images: SampleImages | None
    unfed_positions: Tensor | None
    """(3, len(ids) - fed) the positions of the ids not fed yet; None while decoding: the one id
    not fed is the last sampled token, at `next_position`."""
    fed: int = 0
    next_position: int = 0
    """The position of the token sampled next (all three M-RoPE axes)."""
    images_fed: int = 0
    """Image tokens among the fed ids."""
    budget: int = 0
    """The current turn's max_new_tokens; 0 between turns."""
    seed: int = 0
    """The current turn's seed: its k-th token draws `keyed_uniforms` (seed, k)."""
    turn_logps: list[float] = field(default_factory=list)
    turn_versions: list[int] = field(default_factory=list)


def step_width(unfed: list[int], slots: int, free_positions: int) -> int:
    """How many ids each episode feeds in a step over `slots` slots, given the ids each of the
    stepping episodes has left to feed: the widest step in which padding is at most half the
    positions (or whose slots x width fit `free_positions`), at least 1."""
    width = torch.arange(1, max(unfed) + 1)  # (W,)
    fed = torch.minimum(torch.tensor(unfed)[None, :], width[:, None]).sum(1)  # (W,) real ids at each width
    # fed / width only falls as the width grows: the widths that qualify are 1..the answer
    return max(1, int(((slots * width <= WASTE * fed) | (slots * width <= free_positions)).sum()))


def episode_capacity(prompts: list[Tensor], max_new_tokens: int, max_episode_tokens: int) -> int:
    """The positions a slot needs for these prompts' episodes: env.max_episode_tokens, at least
    the longest prompt and one whole turn."""
    return max(max(len(p) for p in prompts) + max_new_tokens, max_episode_tokens)


class TorchTurnSampler:
    """Multi-turn episodes' policy turns over one slot cache; see the module docstring."""

    def __init__(self, model: nn.Module, slots: int, capacity: int, params: SamplingParams,
                 seed_parts: tuple[int | str, ...], policy_version: int, static: StaticDecoder | None = None,
                 precision: Callable[[], AbstractContextManager] = nullcontext, free_positions: int = 0,
                 stop_text: TurnStop | None = None):
        """`slots`: episodes at once (keys 0..slots-1); `capacity`: positions per episode
        (env.max_episode_tokens): a turn starts only if its context and max_new_tokens - 1 more fit;
        `seed_parts`: the mini-batch's (job seed, "rollout", iteration, mini-batch), which with its
        slot name an episode whose request names none (`seeding.TurnSeeds`); `policy_version`: the
        model's weights' version (set it when they change: each token records the version that
        sampled it); `static`: a text model's steps over its bucket's cache; `precision`: the
        autocast context every forward runs in; `free_positions`: a step of up to this many
        positions (slots x width) costs about what a one-token step does (`step_width`);
        `stop_text`: params' stop_strings (required when it has some)."""
        if params.stop_strings and stop_text is None:
            raise ValueError(f"TorchTurnSampler: stop_strings={params.stop_strings!r} need a stop_text (TurnStop)")
        self.stop_text = stop_text
        if has_sliding_layers(model):
            raise ValueError("TorchTurnSampler: the model has sliding-window layers; the slot cache masks "
                             "full attention only")
        self.model, self.params, self.seeds = model, params, TurnSeeds(seed_parts)
        self.slots, self.capacity, self.policy_version = slots, capacity, policy_version
        self.precision, self.free_positions = precision, free_positions
        self.decoder, self.lm_head = model.get_decoder(), model.get_output_embeddings()
        self.device = self.lm_head.weight.device
        self.vision = is_vision_language_model(model)
        self.banned = model.config.image_token_id if self.vision else None
        if self.banned == params.pad_token_id:
            raise ValueError(f"pad_token_id={params.pad_token_id}: must not be the image token")
        self.static = static if not self.vision else None  # M-RoPE steps run eagerly
        self.stop_ids = torch.tensor(params.stop_token_ids, dtype=torch.long, device=self.device)
        self.episodes: dict[int, _Episode] = {}
        self.turning: set[int] = set()
        """The episodes in a turn: each has ids to feed (its new context, or its last sampled token)."""
        self.compact = self.static is None
        """Eager steps: the turning episodes hold the cache's first rows and a step covers only
        them (a static bucket's rows, under its CUDA graphs, stay where they are: row = key)."""
        self.row_of: dict[int, int] = {}
        """Each episode's row of the cache."""
        self.key_at: list[int | None] = [None] * slots
        """The episode in each row (None: free)."""
        # +1: a step's padding past a slot's end is clamped to the last column, which no episode then holds
        with torch.inference_mode():
            if self.static is not None:
                self.cache = self.static.cache(slots, capacity + 1, self.device)
            else:
                self.cache = SlotCache(slots, capacity + 1, self.device)
            self._allocate()

    def _allocate(self) -> None:
        """Buffers with the layers, heads, head size and dtype the model's attention writes (under
        `precision`): one forward of one token shows them."""
        probe = PreallocatedCache(1)
        token = torch.full((1, 1), self.params.pad_token_id, dtype=torch.long, device=self.device)
        positions = torch.zeros((3, 1, 1) if self.vision else (1, 1), dtype=torch.long, device=self.device)
        with self.precision():
            self.decoder(input_ids=token, position_ids=positions, **cache_argument(self.decoder, probe), use_cache=True)
        self.cache.allocate_like(probe.layers)

    @property
    def busy(self) -> bool:
        return bool(self.turning)

    def start(self, request: TurnRequest) -> None:
        key, context = request.key, request.context.cpu()
        if not 0 <= key < self.slots:
            raise ValueError(f"TurnRequest.key={key}: the sampler holds episodes 0..{self.slots - 1}")
        if key in self.turning:
            raise ValueError(f"episode {key}: a turn started while its previous turn has not ended")
        if request.max_new_tokens < 1:
            raise ValueError(f"episode {key}: max_new_tokens={request.max_new_tokens}: must be >= 1")
        needed = context.numel() + request.max_new_tokens - 1  # the turn's last token is not fed
        if needed > self.capacity:
            raise ValueError(f"episode {key}: a context of {context.numel()} ids and max_new_tokens="
                             f"{request.max_new_tokens} need {needed} positions; the sampler holds "
                             f"{self.capacity} per episode (env.max_episode_tokens)")
        if self.vision and request.images is not None:
            check_sample_images(key, context, request.images, self.model.config)
        elif request.images is not None or (self.vision and bool((context == self.banned).any())):
            raise ValueError(f"episode {key}: images must come with image tokens and a vision-language model")
        ids = context.tolist()
        episode = self.episodes.get(key)
        if episode is None:
            if not ids:
                raise ValueError(f"episode {key}: an empty context")
            episode = self.episodes[key] = _Episode(ids, request.images, torch.zeros((3, 0), dtype=torch.long))
            row = self.key_at.index(None) if self.compact else key  # the rows of turning episodes are all taken
            self.row_of[key], self.key_at[row] = row, key
        elif ids[:len(episode.ids)] != episode.ids:
            raise ValueError(f"episode {key}: the context must begin with the episode's ids so far "
                             f"({len(episode.ids)} ids: its previous context and turn)")
        episode.ids, episode.images, episode.budget = ids, request.images, request.max_new_tokens
        episode.seed = self.seeds.next(key, request.episode)
        if self.vision:  # M-RoPE positions of the whole context (its images as grids)
            grid = request.images.grid_thw if request.images is not None else torch.zeros((0, 3), dtype=torch.long)
            episode.unfed_positions = mrope_positions(context, grid, self.model.config)[:, episode.fed:]
        else:
            episode.unfed_positions = torch.arange(episode.fed, len(ids)).expand(3, -1)
        self._move(key, len(self.turning))  # the row after the turning ones'
        self.turning.add(key)

    def _move(self, key: int, row: int) -> None:
        """Eager steps: episode `key` trades rows with whatever holds `row`."""
        mine = self.row_of[key]
        if not self.compact or mine == row:
            return
        other = self.key_at[row]
        with torch.inference_mode():
            self.cache.swap(mine, row)
        self.key_at[mine], self.key_at[row], self.row_of[key] = other, key, row
        if other is not None:
            self.row_of[other] = mine

    def _stop_turning(self, key: int) -> None:
        """The episode leaves the turning ones (and their first rows)."""
        if key in self.turning:
            self._move(key, len(self.turning) - 1)
            self.turning.discard(key)

    def advance(self) -> list[TurnDone]:
        if not self.busy:
            return []
        with torch.inference_mode(), self.precision():
            keys, logits = self._step(list(self.turning))  # (R,) episodes that fed all they had, (R, V)
            if not keys:
                return []
            ids = torch.empty((len(keys), 1), dtype=torch.long, device=self.device)
            logps = torch.empty((len(keys), 1), device=self.device)
            rows = torch.arange(len(keys), device=self.device)
            token, stop = sample_into(logits, self.params, None, self.stop_ids, ids, logps, rows, 0, self.banned,
                                      self._uniforms(keys))
        done = []
        for key, sampled, logp, stopped in zip(keys, token.tolist(), logps[:, 0].tolist(), stop.tolist()):
            episode = self.episodes[key]
            episode.ids.append(sampled)
            episode.unfed_positions = None
            episode.turn_logps.append(logp)
            episode.turn_versions.append(self.policy_version)
            count = len(episode.turn_logps)
            stopped = stopped or (self.stop_text is not None and self.stop_text(episode.ids[-count:]))
            if stopped or count == episode.budget:
                done.append(self._end(key, "stop" if stopped else "length"))
        return done

    def _uniforms(self, keys: list[int]) -> Tensor | None:
        """(R,) each episode's next number of its turn's stream, on the device; None when greedy."""
        if self.params.temperature == 0:
            return None
        drawing = [self.episodes[key] for key in keys]
        numbers = keyed_uniforms([e.seed for e in drawing], [len(e.turn_logps) for e in drawing])
        return torch.from_numpy(numbers).to(self.device)

    def _end(self, key: int, reason: Literal["stop", "length"]) -> TurnDone:
        episode = self.episodes[key]
        count, versions = len(episode.turn_logps), episode.turn_versions
        turn = TurnDone(key, torch.tensor(episode.ids[-count:], dtype=torch.long),
                        torch.tensor(episode.turn_logps, dtype=torch.float32), reason, min(versions),
                        torch.tensor(versions) if len(set(versions)) > 1 else None)
        episode.turn_logps, episode.turn_versions, episode.budget = [], [], 0
        self._stop_turning(key)
        return turn

    def _step(self, keys: list[int]) -> tuple[list[int], Tensor]:
        """One step (see `advance`): each listed episode feeds its next unfed ids (`step_width` of
        them at most). The episodes that fed all they had, in key order, and their logits (R, V)
        at their last id. Eager: the decoding episodes (one id each) hold the first rows and the
        joining ones the rows after them, and each group is its own forward, so no decoding row
        is padded to a join's width; a static bucket's step covers all its rows (its CUDA graphs'),
        row = key."""
        if not self.compact:
            return self._forward_rows(keys, range(self.cache.slots))
        decoding = [key for key in keys if self.episodes[key].unfed_positions is None]
        joining = [key for key in keys if self.episodes[key].unfed_positions is not None]
        self._arrange(len(decoding), joining)
        parts = [self._forward_rows(group, rows) for group, rows in
                 ((decoding, range(len(decoding))), (joining, range(len(decoding), len(keys)))) if group]
        ready = [key for part_ready, _ in parts for key in part_ready]
        if len(parts) == 1 or not ready:
            return parts[0] if len(parts) == 1 else ([], torch.empty(0))
        order = sorted(range(len(ready)), key=ready.__getitem__)  # key order across the two groups
        logits = torch.cat([part_logits for _, part_logits in parts])[torch.tensor(order, device=self.device)]
        return [ready[i] for i in order], logits

    def _arrange(self, decoders: int, joining: list[int]) -> None:
        """The joining episodes to rows decoders.., the decoding ones to the rows before them."""
        misplaced = [key for key in joining if self.row_of[key] < decoders]  # a decoding one's row is theirs
        joiners = set(joining)
        free = [row for row in range(decoders, decoders + len(joining)) if self.key_at[row] not in joiners]
        for key, row in zip(misplaced, free, strict=True):
            self._move(key, row)

    def _forward_rows(self, keys: list[int], rows: range) -> tuple[list[int], Tensor]:
        """One forward over the cache's `rows`, in which `keys` (their episodes' rows among them)
        feed their next ids; the episodes that fed all they had, in key order, and their logits."""
        keys = sorted(keys, key=self.row_of.__getitem__)  # row order: image features follow it
        episodes = [self.episodes[key] for key in keys]
        width = step_width([len(e.ids) - e.fed for e in episodes], len(rows), self.free_positions)
        tokens = torch.full((len(rows), width), self.params.pad_token_id, dtype=torch.long)  # (S, Q)
        positions = torch.zeros((3, len(rows), width), dtype=torch.long)  # (3, S, Q); padding at 0
        kept = torch.zeros(len(rows), dtype=torch.long)  # (S,)
        decoding = [key for key, episode in zip(keys, episodes) if episode.unfed_positions is None]
        last = dict.fromkeys(decoding, 0)  # the episodes that feed all they have -> their last id's column
        if decoding:  # one id each, at its next position: set for all at once
            feeding = [self.episodes[key] for key in decoding]
            at = torch.tensor([self.row_of[key] - rows.start for key in decoding])
            tokens[at, 0] = torch.tensor([episode.ids[-1] for episode in feeding])
            positions[:, at, 0] = torch.tensor([episode.next_position for episode in feeding])
            kept[at] = 1
            for episode in feeding:
                episode.fed, episode.next_position = episode.fed + 1, episode.next_position + 1
        features = []
        for key, episode in zip(keys, episodes):
            if key in last:
                continue
            row = self.row_of[key] - rows.start
            count = min(width, len(episode.ids) - episode.fed)
            fed = episode.ids[episode.fed:episode.fed + count]
            tokens[row, :count], positions[:, row, :count] = torch.tensor(fed), episode.unfed_positions[:, :count]
            kept[row] = count
            episode.next_position = int(episode.unfed_positions[:, count - 1].max()) + 1
            episode.fed, episode.unfed_positions = episode.fed + count, episode.unfed_positions[:, count:]
            images = sum(1 for t in fed if t == self.banned) if self.vision else 0
            if images:
                features.append(episode.images.features[episode.images_fed:episode.images_fed + images])
                episode.images_fed += images
            if episode.fed == len(episode.ids):
                last[key] = count - 1
        tokens = tokens.to(self.device)
        positions = (positions if self.vision else positions[0]).to(self.device)  # M-RoPE (3, S, Q) or (S, Q)
        if features:
            inputs = language_model_inputs(self.model, tokens, torch.cat(features))
            hidden = self._forward(self.cache, inputs, positions, rows)[0]  # (S, Q, H)
        elif self.static is not None and width == 1:
            hidden = self.static.step(self.cache, "turn", self._token_forward, tokens, positions)[0]
        else:
            hidden = self._token_forward(self.cache, tokens, positions, rows)[0]
        self.cache.commit(kept.to(self.device))
        if not last:
            return [], hidden.new_zeros(0)
        ready = sorted(last)
        at = torch.tensor([self.row_of[key] - rows.start for key in ready], device=self.device)  # (R,)
        column = torch.tensor([last[key] for key in ready], device=self.device)  # (R,)
        return ready, self.lm_head(hidden[at, column]).float()

    def _token_forward(self, cache: SlotCache, tokens: Tensor, positions: Tensor,
                       rows: range | None = None) -> tuple[Tensor]:
        return self._forward(cache, {"input_ids": tokens}, positions, rows)

    def _forward(self, cache: SlotCache, inputs: dict, positions: Tensor, rows: range | None = None) -> tuple[Tensor]:
        """The decoder over the cache's `rows` (all: None): inputs (S, Q), positions (S, Q) or
        (3, S, Q) -> hidden (S, Q, H)."""
        mask = cache.begin(positions.shape[-1], rows)  # (S, 1, Q, C)
        return (self.decoder(**inputs, attention_mask=mask, position_ids=positions,
                             **cache_argument(self.decoder, cache), use_cache=True).last_hidden_state,)

    def release(self, key: int) -> None:
        self._stop_turning(key)
        self.seeds.release(key)
        if self.episodes.pop(key, None) is not None:
            row = self.row_of.pop(key)
            self.key_at[row] = None
            with torch.inference_mode():
                self.cache.clear(torch.tensor([row], device=self.device))

    def close(self) -> None:
        for key in list(self.episodes):
            self.release(key)
