"""Config of the reward (`reward`, with its process rewards `reward.process`) and of the critic
(`critic`), beside `rl/config.py`.

    reward:
      function: stream_rlhf.data.arithmetic:final_reward      # the outcome, on the last token
      process: {function: stream_rlhf.data.arithmetic:step_reward, separator: ",", weight: 0.5}
    critic: {lr: 1.0e-3, init: reward_model, warmup_iterations: 2}

The scorers are `stages/process_reward.py`; where the step rewards go is `algos/process_rewards.py`.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Annotated, Literal

from msgspec import Meta

from stream_rlhf.backends.optimizer_config import OptimizerConfig
from stream_rlhf.config import ConfigError, check_fields, import_dotted
from stream_rlhf.rl.reward_pool import OUTCOME, STEPS, Kind


@dataclass(frozen=True)
class ProcessRewardConfig:
    """Process rewards: one score per reasoning step of a response, from a rule function or a
    process reward model (PRM), placed on the token that ends each step.

    The response is cut into steps at each `separator` token; the text after the last separator
    (if any) is the final step, ending at the response's last token, where the outcome reward
    (`reward.function` / `reward.model_path`) sits too. The token-level reward is
    outcome (last token) + weight * step score (each step's end token) - the KL penalty, which
    GAE (with the critic) and REINFORCE++ turn into per-token advantages: a wrong step lowers
    the advantage of the tokens up to it.

    GRPO and RLOO sum: a sample's score is its outcome plus weight times the sum of its step
    scores, normalised over the prompt's group like an outcome-only score (one advantage for the
    whole response; no per-step credit, which needs gae or reinforce_pp).

    In an `env` job's episodes only policy tokens make steps: a separator the policy wrote ends
    one, and so does each policy turn's last token (no step spans an observation).
    """

    function: str | None = None
    """Dotted path "package.module:name" of `fn(prompt, steps, reference) -> list[float]`, one score
    per step (`steps`: each step's text, separator left out, decoded without special tokens)."""
    model_path: str | None = None
    """A Hugging Face token-classification checkpoint with one label (a PRM, e.g. from
    `python -m stream_rlhf.models.prm`); a step's score is sigmoid(logit) at its end token. It
    must share the policy's tokenizer."""
    separator: Annotated[str, Meta(min_length=1)] = ","
    """The text that ends a step; it must be one token of the policy's tokenizer."""
    weight: float = 1.0
    """How much a step score counts against the outcome reward (which has weight 1 here)."""

    def __post_init__(self) -> None:
        check_fields(self)
        if (self.function is None) == (self.model_path is None):
            raise ConfigError(f"function={self.function!r}, model_path={self.model_path!r}: give one of them")
        if self.function is not None and not callable(import_dotted(self.function, "function")):
            raise ConfigError(f"function={self.function!r}: not callable (expected fn(prompt, steps, reference))")
        if self.model_path is not None and not os.path.isfile(os.path.join(self.model_path, "config.json")):
            raise ConfigError(f"model_path={self.model_path!r}: no config.json there")
        if not math.isfinite(self.weight):
            raise ConfigError(f"weight={self.weight}: must be finite")


@dataclass(frozen=True)
class CriticConfig(OptimizerConfig):
    """The critic's optimizer (as `actor`'s), where its weights come from, and its warm-up."""

    lr: Annotated[float, Meta(gt=0)] = 1e-3
    """AdamW's learning rate of the critic: 10x the actor's by default (an actor.lr above it is
    warned about: PPO tends to diverge when the policy moves faster than its value estimates)."""
    init: Literal["policy", "reward_model"] = "policy"
    """policy: the starting policy's backbone with a zero value head. reward_model: the backbone
    and scalar head of `reward.model_path` (a sequence-classification model of the policy's
    architecture and vocabulary), so the critic starts out scoring what the reward scores."""
    warmup_iterations: Annotated[int, Meta(ge=0)] = 0
    """The first N iterations train only the critic: the actor stays frozen, publishes no weights,
    and rollout keeps generating with version 0 (counted as `critic_warmup` in metrics.jsonl)."""


def policy_version_at(iteration: int, warmup_iterations: int) -> int:
    """The actor's policy version while it trains `iteration`: iterations before the critic's
    warm-up ends leave it at 0, and each later one adds a version."""
    return max(0, iteration - warmup_iterations)


def iterations_trained_at(policy_version: int, warmup_iterations: int) -> int:
    """The fewest iterations the actor has trained once it is at `policy_version`: the version
    plus the warm-up's past it; 0 at version 0 (which lasts the whole warm-up)."""
    return policy_version + warmup_iterations if policy_version > 0 else 0


@dataclass(frozen=True)
class RewardConfig:
    """Score = function_weight * function(prompt, response, reference) + model_weight * reward model,
    on each response's last token (an episode's last policy token; its turn rewards come from the
    `env`); `process` adds step rewards (`reward_parts_config.py`)."""

    function: str | None = "stream_rlhf.data.arithmetic:reward"
    """Dotted path "package.module:name" of a rule-based reward; None for none (then `model_path`
    or an `env`, whose turn rewards are the reward, is needed). With an `env` it scores the whole
    episode: `response` is every token after the prompt, observations included."""
    function_weight: float = 1.0
    """What the rule-based reward's score is multiplied by in the sum."""
    model_path: str | None = None
    """A Hugging Face sequence-classification checkpoint with one label (the scalar head); it reads
    the whole sequence (an episode's observations included)."""
    model_weight: float = 1.0
    """What the reward model's score is multiplied by in the sum."""
    process: ProcessRewardConfig | None = None
    """Process rewards at the steps of a response (a rule function or a PRM); None: outcome only."""
    workers: Annotated[int, Meta(ge=0)] = 0
    """0: `function` and `process.function` run in the reward stage's process, one sample after
    another, with no time limit. N: in N processes of their own, N samples at once, each call
    bounded by `timeout_s` (`rl/reward_pool.py`): for a verifier that is slow in pure Python or may
    never return. Their arguments and scores are pickled across."""
    timeout_s: Annotated[float, Meta(gt=0)] = 30.0
    """With `workers`: a call past this many seconds scores `timeout_score` (each of its steps, for
    `process.function`), is logged and counted (summary.json `reward_timeouts`), and its process is
    killed and replaced."""
    timeout_score: float = 0.0
    """With `workers`: the score of a call past `timeout_s`."""

    def pooled_functions(self) -> dict[Kind, str]:
        """What `workers` run, by kind: the outcome and the process rule, where given."""
        functions: dict[Kind, str] = {OUTCOME: self.function} if self.function is not None else {}
        if self.process is not None and self.process.function is not None:
            functions[STEPS] = self.process.function
        return functions

    def __post_init__(self) -> None:
        check_fields(self)
        if self.workers and not self.pooled_functions():
            raise ConfigError(f"workers={self.workers}: there is no reward function to run in them (function and "
                              "process.function are None)")
        if self.function is not None and not callable(import_dotted(self.function, "function")):
            raise ConfigError(f"function={self.function!r}: not callable (expected fn(prompt, response, reference))")
        if self.model_path is not None and not os.path.isfile(os.path.join(self.model_path, "config.json")):
            raise ConfigError(f"model_path={self.model_path!r}: no config.json there")
