"""Runs one mini-batch's episodes: environment resets, policy turns through a rollout engine's
`TurnSampler`, environment steps through the `EnvStepper`, the engine's limits and failures.

    loop = EpisodeLoop(env_cfg, tokenizer, max_new_tokens=32)
    result = loop.run(starts, prompts, images, sampler, stepper, observe)   # observe: images in observations
    result.episodes[i], result.ended[i], result.tool_waits, result.tool_hidden_s

    dataflow of one episode (each arrow is asynchronous: other episodes go on meanwhile)

        reset ──> turn 1 ──> step ──> observation ──> turn 2 ──> step ──> ... ──> done / limit / failure
                  (sampler)  (stepper)                (sampler)

`env.schedule: stream` starts an episode's next turn as soon as its environment has answered, so
the sampler decodes for the other episodes while one waits for its tool. `lockstep` is the
baseline of a synchronous engine: every live episode's turn k starts together, once the slowest
environment call of round k-1 has returned.

Every step of an episode goes through its environment, the last one too (its reward scores the
final answer). An episode ends when the environment says done, when a limit is reached
(`env.max_turns`; `env.max_episode_tokens`, whose observation is then not appended), or when a
call fails (raised, timeout, malformed): it keeps the turns it has, with reward 0 for the failing
turn, and `ended` says why ("failed:timeout"). A failed reset still samples the first turn (the
policy's answer to the prompt), so every episode has at least one policy turn and no sample is lost.

An observation with images (a vision-language policy) goes through `observe`
(`envs/observation_images.py`: its ids with each image's pad run, and the images' features); the
episode's images are then its prompt's followed by its observations', in token order, and every
later turn's request carries them all. Without `observe` (a text policy, an engine that takes no
such images), or when `observe` raises ValueError, the episode fails as "malformed".
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import Tensor

from stream_rlhf.envs.config import EnvConfig
from stream_rlhf.envs.environment import Environment, EpisodeStart, Observation
from stream_rlhf.envs.episode import Episode
from stream_rlhf.envs.stepper import EnvStepper, Outcome
from stream_rlhf.envs.turns import TurnDone, TurnRequest, TurnSampler
from stream_rlhf.samples import SampleImages

log = logging.getLogger("stream_rlhf")
IDLE_WAIT_S = 0.05
"""How long the loop blocks on the environments when the sampler has nothing to decode."""
Phase = Literal["reset", "turn", "step", "ready", "over"]
ObserveImages = Callable[[Observation], tuple[list[int], SampleImages]]
"""An observation with images -> its ids (each image's pad run in place) and its encoded images;
ValueError for one it cannot take."""


@dataclass
class EpisodeResult:
    """A mini-batch's episodes and what happened in them, in sample order."""

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
    """Seconds during which an environment call was running and the sampler had turns to decode."""
    tool_wall_s: float = 0.0
    """Seconds during which an environment call was running."""
    failures: list[str] = field(default_factory=list)
    """One line per failed episode: its index and the failure's message."""


class EpisodeLoop:
    """The episodes of a mini-batch, driven to their ends (see the module docstring)."""

    def __init__(self, cfg: EnvConfig, decode: Callable[[list[int]], str], encode: Callable[[str], list[int]],
                 max_new_tokens: int):
        self.cfg = cfg
        self.decode, self.encode = decode, encode
        self.max_new_tokens = max_new_tokens

    def run(self, starts: list[EpisodeStart], prompts: list[Tensor], images: list[SampleImages] | None,
            sampler: TurnSampler, stepper: EnvStepper, observe: ObserveImages | None = None) -> EpisodeResult:
        """`images`: each prompt's encoded images (None: a text policy); `observe`: how an
        observation's images become ids and features (None: observations take no images)."""
        n = len(prompts)
        self.episodes = [Episode(prompt_ids=p.tolist()) for p in prompts]
        self.observe = observe
        self.images = list(images) if images is not None else None  # grows by the observations' images
        self.sampler, self.stepper = sampler, stepper
        self.phase: list[Phase] = ["reset"] * n
        self.result = EpisodeResult(self.episodes, [""] * n, [0] * n, [0.0] * n)
        self.envs: list[Environment | None] = []
        for i, start in enumerate(starts):
            try:
                env = self.cfg.make()
            except Exception as exc:  # a factory that raises fails its episode, like a reset that raises
                self.envs.append(None)
                self._fail(i, "raised", f"env.factory raised {type(exc).__name__}: {exc}")
                self.phase[i] = "ready"
                continue
            self.envs.append(env)
            self.stepper.reset(i, env, start)
        while any(phase != "over" for phase in self.phase):
            self._start_ready_turns()
            tick = time.monotonic()
            tools_running = self.stepper.in_flight > 0
            sampling = self.sampler.busy
            for done in self.sampler.advance():
                self._on_turn(done)
            idle = not self.sampler.busy and not self._may_start()
            outcomes = self.stepper.wait(IDLE_WAIT_S) if idle else self.stepper.poll()
            for outcome in outcomes:
                self._on_outcome(outcome)
            if tools_running:
                spent = time.monotonic() - tick
                self.result.tool_wall_s += spent
                self.result.tool_hidden_s += spent if sampling else 0.0
        return self.result

    def _may_start(self) -> bool:
        """Whether an episode's next turn may start now."""
        if self.cfg.schedule == "lockstep" and (self.stepper.in_flight or self.sampler.busy):
            return False  # a round starts once every turn and every environment call of the last one is over
        return "ready" in self.phase

    def _start_ready_turns(self) -> None:
        if not self._may_start():
            return
        for i, phase in enumerate(self.phase):
            if phase != "ready":
                continue
            episode = self.episodes[i]
            # an observation is appended only below the limit, so only a first turn can find no room
            budget = max(1, min(self.max_new_tokens, self.cfg.max_episode_tokens - episode.num_tokens))
            context = torch.tensor(episode.prompt_ids + episode.token_ids, dtype=torch.long)
            images = self.images[i] if self.images is not None else None
            self.sampler.start(TurnRequest(i, context, images, budget))
            self.phase[i] = "turn"

    def _on_turn(self, done: TurnDone) -> None:
        i = done.key
        episode = self.episodes[i]
        episode.add_policy_turn(done.ids.tolist(), done.logps.tolist(), done.policy_version)
        env = self.envs[i]
        if env is None or self.result.ended[i].startswith("failed:"):  # a failed reset: the first turn only
            self._end(i, self.result.ended[i])
            return
        ids = done.ids.tolist()
        self.stepper.step(i, env, self.decode(ids), ids)
        self.result.tool_calls[i] += 1
        self.phase[i] = "step"

    def _on_outcome(self, outcome: Outcome) -> None:
        i = outcome.key
        self.result.tool_s[i] += outcome.seconds
        self.result.tool_waits.append((i, time.time() - outcome.seconds, outcome.seconds))
        if self.phase[i] == "over":
            return
        if outcome.failure is not None:
            self._fail(i, outcome.failure.reason, outcome.failure.message)
            # a failed reset still samples the first turn; a failed step ends the episode
            self.phase[i] = "ready" if self.phase[i] == "reset" else "over"
            if self.phase[i] == "over":
                self._end(i, self.result.ended[i])
            return
        if self.phase[i] == "reset":
            self.phase[i] = "ready"
            return
        episode, turn = self.episodes[i], outcome.turn
        episode.set_turn_reward(float(turn.reward))
        if turn.done:
            self._end(i, "done")
            return
        try:
            ids, images = self._observation_ids(turn.observation)
        except ValueError as exc:
            self._fail(i, "malformed", f"Observation.images: {exc}")
            self._end(i, self.result.ended[i])
            return
        limit = "max_turns" if episode.turns >= self.cfg.max_turns else None
        if limit is None and episode.num_tokens + len(ids) >= self.cfg.max_episode_tokens:
            limit = "max_episode_tokens"
        if limit is not None:
            self._end(i, limit)
            return
        if ids:
            episode.add_observation(ids, images)
        if images is not None and self.images is not None:
            self.images[i] = self.images[i].followed_by(images)
        self.phase[i] = "ready"

    def _observation_ids(self, observation: Observation | None) -> tuple[list[int], SampleImages | None]:
        """The ids an observation appends and, when it has images, their encoded images."""
        if observation is None:
            return [], None
        if not observation.images:
            return self.encode(observation.text), None
        if self.observe is None or self.images is None:
            raise ValueError("this rollout takes no images in observations (they need a vision-language "
                             "policy on rollout.backend=torch)")
        return self.observe(observation)

    def _fail(self, i: int, reason: str, message: str) -> None:
        self.result.ended[i] = f"failed:{reason}"
        self.result.failures.append(f"episode {i}: {message}")

    def _end(self, i: int, why: str) -> None:
        self.result.ended[i] = why
        self.phase[i] = "over"
        self.sampler.release(i)
