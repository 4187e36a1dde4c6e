"""The interface of an environment: what a user implements, in plain Python, for multi-turn and
tool-using episodes.

    class Calculator:                                   # sync, or `async def` for both methods
        def reset(self, start: EpisodeStart) -> None: ...
        def step(self, text: str, token_ids: Sequence[int]) -> Turn:
            return Turn(Observation("=1368 "), reward=0.0, done=False)

One environment object serves one episode: `env.factory` (a dotted path, as `reward.function`)
makes a fresh one per episode, `reset` gives it the dataset sample, and each `step` gets one policy
turn, both as text (decoded without special tokens) and as the token ids the policy generated
(never re-tokenised). The returned `Turn` says what to append (an `Observation`: text, and images
for a vision-language policy), the turn's reward, and whether the episode is over. Turn and token
limits are the engine's (`env.max_turns`, `env.max_episode_tokens`), not the environment's. An
environment that holds something to give back (a sandbox, a connection) may define `close()`, sync
or async: the engine calls it once, after the episode's last call, however the episode ended
(done, a limit, a failure, or rollout stopping with the episode in flight).

Glossary: an *episode* is one prompt and every turn after it; a *turn* is one policy response
(ending at a stop token) and the environment's answer to it; an *observation* is the part the
environment appends, which carries no loss and no log-probs.
"""

from __future__ import annotations

from collections.abc import Awaitable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(frozen=True)
class EpisodeStart:
    """The dataset sample an episode starts from."""

    prompt: str
    reference: str
    images: tuple[str, ...] = ()
    """Paths of the prompt's images, in the order of its image markers."""
    fields: Mapping[str, Any] = field(default_factory=dict)
    """The sample's extra columns (as `data.fields` maps them), by name."""


@dataclass(frozen=True)
class Observation:
    """What an environment appends after a policy turn: text, and images for a vision-language
    policy (paths; see docs/environments.md, "Images in observations")."""

    text: str
    images: tuple[str, ...] = ()
    role: str | None = None
    """None: the text is appended as written. A role ("tool", "user"): the observation is a chat
    message of that role, written around the text as the job's chat template writes one after an
    assistant turn, up to the next assistant turn's header (`data/message_frames.py`)."""


@dataclass(frozen=True)
class Turn:
    """The result of one `step`: the observation to append (None: nothing; a tuple: several, in
    order, e.g. one `tool` message per call), the turn's reward (placed on the turn's last policy
    token) and whether the episode is over."""

    observation: Observation | tuple[Observation, ...] | None
    reward: float = 0.0
    done: bool = False

    @property
    def observations(self) -> tuple[Observation, ...]:
        """The observations to append, in order (none, one or several)."""
        if self.observation is None:
            return ()
        return self.observation if isinstance(self.observation, tuple) else (self.observation,)


class Environment(Protocol):
    """One episode's environment; both methods may be `async def`. It may also define `close()`
    (sync or async), called once when the episode is over (`envs/stepper.py`)."""

    def reset(self, start: EpisodeStart) -> None | Awaitable[None]:
        """Start the episode from a dataset sample."""

    def step(self, text: str, token_ids: Sequence[int]) -> Turn | Awaitable[Turn]:
        """Answer one policy turn (`text` decoded without special tokens, `token_ids` as generated)."""
