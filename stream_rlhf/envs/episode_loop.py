"""Runs multi-turn episodes: environment resets, policy turns through a rollout engine's
`TurnSampler`, environment steps through the `EnvStepper`, the engine's limits and failures.
Episodes come in groups (a mini-batch's), and several groups may be in flight at once, sharing
the sampler: while one group's episodes wait for their tools, the sampler decodes the others'.

    loop = EpisodeLoop(env_cfg, decode, encode, max_new_tokens=32)
    result = loop.run(starts, prompts, images, sampler, stepper, observe)   # one group, to its end

    loop.open(sampler, stepper, observe)            # or groups in flight (the rollout stage's)
    loop.add("mb 3", starts, prompts, images)       # takes free sampler slots (loop.free_slots)
    for tag, result in loop.advance(): ...          # some work; the groups whose episodes all ended
    result.episodes[i], result.ended[i], result.tool_waits, result.tool_hidden_s

    dataflow of one episode (each arrow is asynchronous: other episodes go on meanwhile)

        reset ──> turn 1 ──> step ──> observation ──> turn 2 ──> step ──> ... ──> done / limit / failure
                  (sampler)  (stepper)                (sampler)

`env.schedule: stream` sends a turn to its environment as soon as it ends and starts the episode's
next turn as soon as the environment has answered, so the sampler decodes for the other episodes
while one waits for its tool. `lockstep` is the baseline of a synchronous engine (one group at a
time): round k's environment calls start together once every turn of round k has ended (the
batch's generation has returned), and every live episode's turn k+1 starts together once the
slowest of those calls has returned.

Every step of an episode goes through its environment, the last one too (its reward scores the
final answer). An episode ends when the environment says done, when a limit is reached
(`env.max_turns`; `env.max_episode_tokens`, whose observation is then not appended), or when a
call fails (raised, timeout, malformed): it keeps the turns it has, with reward 0 for the failing
turn, and `ended` says why ("failed:timeout"). A failed reset still samples the first turn (the
policy's answer to the prompt), so every episode has at least one policy turn and no sample is lost.
Its environment is then released to the stepper, which calls its `close()` if it has one.

An observation with images (a vision-language policy) goes through `observe`
(`envs/observation_images.py`: its ids with each image's pad run, and the images' features; the
observations of answers that came back together in one call of the vision tower); the
episode's images are then its prompt's followed by its observations', in token order, and every
later turn's request carries them all. Without `observe` (a text policy), past
`env.max_observation_images`, or when `observe` raises ValueError, the episode fails as "malformed".
A turn may append several observations (a tuple: one message per tool call). An observation with
a role is a chat message: its ids go in the frame the chat template writes around such messages
(`data/message_frames.py`, the loop's `frames`); without a template, for roles the template
cannot write, or for a turn whose observations mix messages and plain text, the episode fails as
"malformed".
"""

from __future__ import annotations

import heapq
import itertools
import logging
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import Tensor

from stream_rlhf.data.message_frames import MessageFrames
from stream_rlhf.envs.config import EnvConfig
from stream_rlhf.envs.environment import Environment, EpisodeStart, Observation
from stream_rlhf.envs.episode import Episode
from stream_rlhf.envs.observation_cut import ObservationCut
from stream_rlhf.envs.observation_images import ObservationImages
from stream_rlhf.envs.stepper import EnvStepper, Outcome
from stream_rlhf.envs.turns import TurnDone, TurnRequest, TurnSampler
from stream_rlhf.samples import SampleImages

log = logging.getLogger("stream_rlhf")
IDLE_WAIT_S = 0.05
"""How long the loop blocks on the environments when the sampler has nothing to decode."""
Phase = Literal["reset", "turn", "step", "ready"]


@dataclass
class EpisodeResult:
    """A group's episodes and what happened in them, in sample order."""

    episodes: list[Episode]
    ended: list[str]
    """Why each ended: "done", "max_turns", "max_episode_tokens" or "failed:<reason>"."""
    tool_calls: list[int]
    """Environment steps per episode."""
    tool_s: list[float]
    """Seconds each episode's environment calls took (resets and steps)."""
    tool_waits: list[tuple[int, float, float]] = field(default_factory=list)
    """(episode, start unix seconds, seconds) of every environment call."""
    tool_hidden_s: float = 0.0
    """Seconds during which one of the group's environment calls was running and the sampler had
    turns to decode."""
    tool_wall_s: float = 0.0
    """Seconds during which one of the group's environment calls was running."""
    failures: list[str] = field(default_factory=list)
    """One line per failed episode: its index and the failure's message."""
    observations_cut: list[int] = field(default_factory=list)
    """Observations of each episode cut to env.max_observation_tokens."""


@dataclass
class _Group:
    tag: Hashable
    result: EpisodeResult
    live: int
    """Episodes not over yet."""
    seed_parts: tuple[int | str, ...]
    """Its episodes' identity before their index (TurnRequest.episode); empty: none given."""
    tools_running: int = 0
    """Environment calls of this group's episodes in progress."""


@dataclass
class _Live:
    """One episode in flight: its group, its index there and its sampler slot."""

    group: _Group
    index: int
    slot: int
    env: Environment | None
    images: SampleImages | None
    """Its images so far (prompt's, then its observations'); None for a text policy."""
    phase: Phase = "reset"


class EpisodeLoop:
    """Episodes driven to their ends, a group at a time or several (see the module docstring)."""

    def __init__(self, cfg: EnvConfig, decode: Callable[[list[int]], str], encode: Callable[[str], list[int]],
                 max_new_tokens: int, frames: MessageFrames | None = None,
                 make: Callable[[], Environment] | None = None):
        """`frames`: how the chat template writes an observation with a role (None: no template);
        `make`: each episode's environment (default `cfg.make`; `ProcessEnvs.make` with env.processes)."""
        self.cfg = cfg
        self.make = make or cfg.make
        self.decode, self.encode, self.frames = decode, encode, frames
        self.cut = ObservationCut(cfg, encode)
        self.max_new_tokens = max_new_tokens
        self.groups: list[_Group] = []
        self.encoded: dict[int, tuple[list[int], SampleImages] | ValueError] = {}
        """While `advance` handles the answers that came back together: their observations' ids and
        images, encoded in one call (`_encode_together`), by the id of each Observation."""

    def run(self, starts: list[EpisodeStart], prompts: list[Tensor], images: list[SampleImages] | None,
            sampler: TurnSampler, stepper: EnvStepper, observe: ObservationImages | None = None) -> EpisodeResult:
        """One group's episodes on slots 0..len(prompts)-1, to their ends. `images`: each prompt's
        encoded images (None: a text policy); `observe`: how an observation's images become ids and
        features (None: observations take no images)."""
        self.open(sampler, stepper, observe, slots=len(prompts))
        self.add(None, starts, prompts, images)
        while not (ended := self.advance()):
            pass
        return ended[0][1]

    def open(self, sampler: TurnSampler, stepper: EnvStepper, observe: ObservationImages | None, slots: int) -> None:
        """Start over on `sampler`, whose slots 0..slots-1 are all free."""
        if self.groups:
            raise RuntimeError(f"EpisodeLoop.open: {len(self.groups)} group(s) still in flight")
        self.sampler, self.stepper, self.observe = sampler, stepper, observe
        self.free: list[int] = list(range(slots))
        """A heap: an episode takes the lowest free slot (a group alone: slots 0..n-1 in sample order)."""
        self.live: dict[int, _Live] = {}
        """Every episode in flight, by its serial number (its key at the stepper)."""
        self.by_slot: dict[int, int] = {}
        self.serials = itertools.count()
        self.held: list[tuple[int, list[int]]] = []
        """lockstep: (episode, turn ids) of the turns ended whose environment steps wait for the round's last turn."""

    @property
    def free_slots(self) -> int:
        return len(self.free)

    def add(self, tag: Hashable, starts: list[EpisodeStart], prompts: list[Tensor],
            images: list[SampleImages] | None, seed_parts: tuple[int | str, ...] = ()) -> None:
        """A group's episodes join: each takes a free slot and its environment resets. `seed_parts`
        name the group for samplers that seed each turn (TurnRequest.episode: they and the index)."""
        if len(prompts) > len(self.free):
            raise ValueError(f"EpisodeLoop.add: {len(prompts)} episodes, {len(self.free)} free slots")
        result = EpisodeResult([Episode(prompt_ids=p.tolist()) for p in prompts], [""] * len(prompts),
                               [0] * len(prompts), [0.0] * len(prompts), observations_cut=[0] * len(prompts))
        group = _Group(tag, result, live=len(prompts), seed_parts=seed_parts)
        self.groups.append(group)
        for i, start in enumerate(starts):
            serial, slot = next(self.serials), heapq.heappop(self.free)
            self.by_slot[slot] = serial
            try:
                env = self.make()
            except Exception as exc:  # a factory that raises fails its episode, like a reset that raises
                live = self.live[serial] = _Live(group, i, slot, None, images[i] if images is not None else None)
                self._fail(live, "raised", f"env.factory raised {type(exc).__name__}: {exc}")
                live.phase = "ready"
                continue
            self.live[serial] = _Live(group, i, slot, env, images[i] if images is not None else None)
            group.tools_running += 1
            self.stepper.reset(serial, env, start)

    def advance(self) -> list[tuple[Hashable, EpisodeResult]]:
        """Start the turns that may start, one step of the sampler, the environments' answers; the
        groups whose episodes have all ended (in the order they were added), with their results."""
        self._start_ready_turns()
        tick = time.monotonic()
        waiting = [group for group in self.groups if group.tools_running]
        sampling = self.sampler.busy
        for done in self.sampler.advance():
            self._on_turn(done)
        if self.held and not self.sampler.busy:  # lockstep: the round's generation is over
            for serial, ids in self.held:
                self._step_env(serial, ids)
            self.held = []
        idle = not self.sampler.busy and not self._may_start()
        outcomes = self.stepper.wait(IDLE_WAIT_S) if idle else self.stepper.poll()
        self.encoded = self._encode_together(outcomes)
        for outcome in outcomes:
            self._on_outcome(outcome)
        self.encoded = {}
        spent = time.monotonic() - tick
        for group in waiting:
            group.result.tool_wall_s += spent
            group.result.tool_hidden_s += spent if sampling else 0.0
        ended = [group for group in self.groups if not group.live]
        self.groups = [group for group in self.groups if group.live]
        return [(group.tag, group.result) for group in ended]

    def _encode_together(self, outcomes: list[Outcome]) -> dict[int, tuple[list[int], SampleImages] | ValueError]:
        """The observations with images that came back together and that their episodes may show,
        encoded in one call of the vision tower (by the id of each Observation); {} for fewer than two."""
        taken: list[Observation] = []
        for outcome in outcomes:
            live = self.live.get(outcome.key)  # a reset's outcome has no turn
            if outcome.turn is None or outcome.turn.done or live is None:
                continue
            shown = _images_shown(live.group.result.episodes[live.index])
            for o in outcome.turn.observations:
                if o.images and self._image_refusal(live, o, shown) is None:
                    taken.append(o)
                    shown += len(o.images)
        if self.observe is None or len(taken) < 2:
            return {}
        return {id(o): ready for o, ready in zip(taken, self.observe.many(taken), strict=True)}

    def _image_refusal(self, live: _Live, observation: Observation, shown: int) -> str | None:
        """Why the episode cannot show `observation`'s images after `shown` others; None when it can."""
        if self.observe is None or live.images is None:
            return "Observation.images: this rollout takes none (they need a vision-language policy)"
        if shown + len(observation.images) > self.cfg.max_observation_images:
            return (f"Observation.images: the episode's observations would show {shown + len(observation.images)} "
                    f"images, more than env.max_observation_images={self.cfg.max_observation_images}")
        return None

    def _may_start(self) -> bool:
        """Whether an episode's next turn may start now."""
        # (held steps wait only while the sampler is busy: `advance` sends them once it is not)
        if self.cfg.schedule == "lockstep" and (self.stepper.in_flight or self.sampler.busy):
            return False  # a round starts once every turn and every environment call of the last one is over
        return any(live.phase == "ready" for live in self.live.values())

    def _start_ready_turns(self) -> None:
        if not self._may_start():
            return
        for live in self.live.values():
            if live.phase != "ready":
                continue
            episode = live.group.result.episodes[live.index]
            # an observation is appended only below the limit, so only a first turn can find no room
            budget = max(1, min(self.max_new_tokens, self.cfg.max_episode_tokens - episode.num_tokens))
            context = torch.tensor(episode.prompt_ids + episode.token_ids, dtype=torch.long)
            identity = (*live.group.seed_parts, live.index) if live.group.seed_parts else ()
            self.sampler.start(TurnRequest(live.slot, context, live.images, budget, identity))
            live.phase = "turn"

    def _on_turn(self, done: TurnDone) -> None:
        serial = self.by_slot[done.key]
        live = self.live[serial]
        result, ids = live.group.result, done.ids.tolist()
        result.episodes[live.index].add_policy_turn(ids, done.logps.tolist(), done.policy_version,
                                                    done.versions.tolist() if done.versions is not None else None)
        if live.env is None or result.ended[live.index].startswith("failed:"):  # a failed reset: the first turn only
            self._end(serial, result.ended[live.index])
            return
        live.phase = "step"
        if self.cfg.schedule == "lockstep":
            self.held.append((serial, ids))
        else:
            self._step_env(serial, ids)

    def _step_env(self, serial: int, ids: list[int]) -> None:
        """The episode's turn `ids` go to its environment."""
        live = self.live[serial]
        self.stepper.step(serial, live.env, self.decode(ids), ids)
        live.group.tools_running += 1
        live.group.result.tool_calls[live.index] += 1

    def _on_outcome(self, outcome: Outcome) -> None:
        serial = outcome.key
        live = self.live[serial]
        result, i = live.group.result, live.index
        live.group.tools_running -= 1
        result.tool_s[i] += outcome.seconds
        result.tool_waits.append((i, time.time() - outcome.seconds, outcome.seconds))
        if outcome.failure is not None:
            self._fail(live, outcome.failure.reason, outcome.failure.message)
            # a failed reset still samples the first turn; a failed step ends the episode
            if live.phase == "reset":
                live.phase = "ready"
            else:
                self._end(serial, result.ended[i])
            return
        if live.phase == "reset":
            live.phase = "ready"
            return
        episode, turn = result.episodes[i], outcome.turn
        episode.set_turn_reward(float(turn.reward))
        if turn.done:
            self._end(serial, "done")
            return
        try:
            ids, images, paths, cut = self._observation_ids(live, turn.observations)
        except ValueError as exc:
            self._fail(live, "malformed", str(exc))
            self._end(serial, result.ended[i])
            return
        limit = "max_turns" if episode.turns >= self.cfg.max_turns else None
        if limit is None and episode.num_tokens + len(ids) >= self.cfg.max_episode_tokens:
            limit = "max_episode_tokens"
        if limit is not None:
            self._end(serial, limit)
            return
        if ids:
            episode.add_observation(ids, images, paths)
        result.observations_cut[i] += cut
        if images is not None and live.images is not None:
            live.images = live.images.followed_by(images)
        live.phase = "ready"

    def _observation_ids(self, live: _Live, observations: tuple[Observation, ...]
                         ) -> tuple[list[int], SampleImages | None, tuple[str, ...], int]:
        """The ids a turn's observations append (in their chat messages' frame when they have
        roles), their encoded images (None without), the images' paths and how many of the
        observations were cut (`ObservationCut`); ValueError naming the field it cannot take."""
        episode = live.group.result.episodes[live.index]
        shown = _images_shown(episode)
        contents, images, paths, cut = [], None, (), 0
        for o in observations:
            ids, encoded = self._content_ids(live, o, shown)
            if encoded is None:
                ids, was_cut = self.cut(ids)
                cut += was_cut
            else:
                shown += len(encoded.grid_thw)
                images = encoded if images is None else images.followed_by(encoded)
                paths += o.images
            contents.append(ids)
        roles = tuple(o.role for o in observations)
        if all(role is None for role in roles):
            return [t for ids in contents for t in ids], images, paths, cut
        if any(role is None for role in roles):
            raise ValueError(f"Observation.role: {roles}: a turn's observations all have a role or none has")
        if self.frames is None:
            raise ValueError(f"Observation.role={roles}: this rollout writes no chat messages")
        pieces = self.frames.around(roles, episode.token_ids[-1] if episode.token_ids else None)
        ids = pieces[0] + [t for content, after in zip(contents, pieces[1:]) for t in content + after]
        return ids, images, paths, cut

    def _content_ids(self, live: _Live, observation: Observation, shown: int) -> tuple[list[int], SampleImages | None]:
        """One observation's own ids and encoded images, after `shown` images in the episode's observations."""
        if not observation.images:
            return self.encode(observation.text), None
        if (refusal := self._image_refusal(live, observation, shown)) is not None:
            raise ValueError(refusal)
        ready = self.encoded.pop(id(observation), None)
        if ready is None:
            ready = self.observe.many([observation])[0]
        if isinstance(ready, ValueError):
            raise ValueError(f"Observation.images: {ready}") from None
        return ready

    def _fail(self, live: _Live, reason: str, message: str) -> None:
        live.group.result.ended[live.index] = f"failed:{reason}"
        live.group.result.failures.append(f"episode {live.index}: {message}")

    def _end(self, serial: int, why: str) -> None:
        live = self.live.pop(serial)
        live.group.result.ended[live.index] = why
        live.group.live -= 1
        del self.by_slot[live.slot]
        self.sampler.release(live.slot)
        heapq.heappush(self.free, live.slot)
        self.stepper.release(serial)


def _images_shown(episode: Episode) -> int:
    """Images the episode's observations have shown so far."""
    return sum(len(images.grid_thw) for images in episode.observation_images)
