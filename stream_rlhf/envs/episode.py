"""The engine's record of one episode's tokens: policy turns as generated, observations between
them, and what the losses need to tell them apart.

    episode = Episode(prompt_ids=[1, 7, 9])
    episode.add_policy_turn([40, 41, 2], logps=[-0.1, -0.3, -0.2], policy_version=3)
    episode.add_observation([50, 51])                 # the environment's answer: loss mask 0
    episode.add_observation(ids, images)              # ... with images: their SampleImages too
    episode.add_policy_turn([42, 2], logps=[-0.5, -0.1], policy_version=4)
    episode.set_turn_reward(1.0)                      # lands on the last policy turn's last token
    episode.response_tensors()                        # token_ids, loss_mask, behavior_logp, ...

Token-in, token-out: the policy's ids are kept exactly as sampled (never decoded and re-encoded);
observation ids are appended as the tokenizer gave them. Observation positions carry loss mask 0,
behavior log-prob 0.0 (never read: every loss multiplies by the mask) and policy version -1.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from stream_rlhf.samples import SampleImages

OBSERVATION_VERSION = -1
"""The policy version recorded on observation tokens (no policy generated them)."""


@dataclass
class Episode:
    """Prompt ids plus the response side of one episode: every token after the prompt."""

    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    """1 on policy tokens, 0 on observation tokens."""
    behavior_logp: list[float] = field(default_factory=list)
    """The sampling policy's log-prob of each policy token; 0.0 on observation tokens."""
    policy_versions: list[int] = field(default_factory=list)
    """The policy version that generated each token (off-policy correction per token); -1 on observations."""
    turn_ends: list[int] = field(default_factory=list)
    """Index (into token_ids) of each policy turn's last token."""
    turn_rewards: list[float] = field(default_factory=list)
    """One reward per policy turn, placed on its last token."""
    observation_images: list[SampleImages] = field(default_factory=list)
    """The encoded images of the observations that had some, in token order (after the prompt's)."""
    observation_image_paths: list[str] = field(default_factory=list)
    """Their files, in the same order (for the sample log)."""

    @property
    def turns(self) -> int:
        return len(self.turn_ends)

    @property
    def num_policy_tokens(self) -> int:
        return sum(self.loss_mask)

    @property
    def num_tokens(self) -> int:
        """Prompt and response tokens: the length of the packed sequence."""
        return len(self.prompt_ids) + len(self.token_ids)

    def add_policy_turn(self, ids: list[int], logps: list[float], policy_version: int,
                        versions: list[int] | None = None) -> None:
        """`versions`: each token's policy version when the policy changed during the turn (else
        every token is `policy_version`'s)."""
        if not ids:
            raise ValueError("a policy turn needs at least one token")
        if len(logps) != len(ids):
            raise ValueError(f"{len(ids)} token ids but {len(logps)} log-probs")
        self.token_ids.extend(ids)
        self.loss_mask.extend([1] * len(ids))
        self.behavior_logp.extend(logps)
        if versions is not None and len(versions) != len(ids):
            raise ValueError(f"{len(ids)} token ids but {len(versions)} versions")
        self.policy_versions.extend(versions if versions is not None else [policy_version] * len(ids))
        self.turn_ends.append(len(self.token_ids) - 1)
        self.turn_rewards.append(0.0)

    def add_observation(self, ids: list[int], images: SampleImages | None = None,
                        image_paths: tuple[str, ...] = ()) -> None:
        """Append an observation's ids; `images`: the encoded images whose pad runs `ids` holds,
        read from `image_paths`."""
        if not self.turn_ends:
            raise ValueError("an observation must follow a policy turn")
        if images is not None:
            self.observation_images.append(images)
            self.observation_image_paths.extend(image_paths)
        self.token_ids.extend(ids)
        self.loss_mask.extend([0] * len(ids))
        self.behavior_logp.extend([0.0] * len(ids))
        self.policy_versions.extend([OBSERVATION_VERSION] * len(ids))

    def set_turn_reward(self, reward: float) -> None:
        """The reward of the latest policy turn."""
        if not self.turn_ends:
            raise ValueError("no policy turn to reward yet")
        self.turn_rewards[-1] = reward

    def token_rewards(self) -> Tensor:
        """(R,) float: each turn's reward on its last policy token, 0 elsewhere."""
        rewards = torch.zeros(len(self.token_ids))
        for end, reward in zip(self.turn_ends, self.turn_rewards, strict=True):
            rewards[end] += reward
        return rewards

    def response_tensors(self) -> dict[str, Tensor]:
        """The response side as tensors of length R: token ids, loss mask, behavior log-probs,
        policy versions and per-token rewards."""
        return {
            "token_ids": torch.tensor(self.token_ids, dtype=torch.long),
            "loss_mask": torch.tensor(self.loss_mask, dtype=torch.bool),
            "behavior_logp": torch.tensor(self.behavior_logp, dtype=torch.float32),
            "policy_versions": torch.tensor(self.policy_versions, dtype=torch.long),
            "token_rewards": self.token_rewards(),
        }


def limit_reached(episode: Episode, max_turns: int, max_episode_tokens: int) -> str | None:
    """Why the engine ends `episode` now ("max_turns", "max_episode_tokens"), or None."""
    if episode.turns >= max_turns:
        return "max_turns"
    if episode.num_tokens >= max_episode_tokens:
        return "max_episode_tokens"
    return None
