"""Reward: a rule-based function (dotted path in the config), a reward model with a scalar head,
or both, combined as `function_weight * function + model_weight * model`, one score per sample;
with `reward.process`, also each response's step rewards per token (`process_reward.py`).

A rule-based function has the signature `fn(prompt: str, response: str, reference: str, **extra)
-> float`; the response is decoded without special tokens, and `extra` holds the dataset columns
`data.fields` names beside the reference (none by default).

With an `env`, the response is the whole episode after the prompt: every policy turn and every
observation between them, as one text (the reward model likewise reads the whole sequence); its
score lands on the episode's last policy token. The env's own per-turn rewards do not pass through
here: they travel in the rollout handle's `env_rewards` and the trainers add them
(`Experience.token_rewards`). Without a function and a model (allowed only with an env) the
score is 0. Process rewards on an episode cut only its policy tokens into steps, each turn's last
token ending one (the handle's `loss_mask`; `algos/process_rewards.py`).
"""

from __future__ import annotations

import json
from collections.abc import Callable

import torch

from stream_rlhf.backends.forward_engine import RewardModelEngine
from stream_rlhf.config import import_dotted
from stream_rlhf.data.tokenizer import load_tokenizer
from stream_rlhf.samples import Rollout, ragged, unragged
from stream_rlhf.stage import Batch, Output, Stage, StageContext
from stream_rlhf.stages.job_context import JobContext
from stream_rlhf.stages.process_reward import ProcessScorer
from stream_rlhf.stages.topics import REWARD_KWARGS, topic_output

RewardFunction = Callable[..., float]


class Scorer:
    """The configured reward: rule-based function, reward model, or both (also used by evaluation)."""

    def __init__(self, job: JobContext):
        self.cfg = job.config.reward
        self.tokenizer = load_tokenizer(job.checkpoint)
        self.function: RewardFunction | None = (
            import_dotted(self.cfg.function, "reward.function") if self.cfg.function else None)
        self.reward_model = RewardModelEngine(self.cfg.model_path) if self.cfg.model_path else None

    def score(self, rollout: Rollout, references: list[str], reward_kwargs: list[dict] | None = None) -> torch.Tensor:
        """(N,) scores of the sequences of `rollout`; `reward_kwargs`: each sample's extra keyword
        arguments of the reward function (None: none)."""
        scores = torch.zeros(len(rollout.sequences))
        if self.function is not None:
            kwargs = reward_kwargs if reward_kwargs is not None else [{}] * len(references)
            scores += self.cfg.function_weight * self._rule_scores(rollout, references, kwargs)
        if self.reward_model is not None:
            scores += self.cfg.model_weight * self.reward_model.scores(rollout.sequences)
        return scores

    def _rule_scores(self, rollout: Rollout, references: list[str], reward_kwargs: list[dict]) -> torch.Tensor:
        decode = self.tokenizer.decode
        scores = []
        for sequence, prompt_len, reference, kwargs in zip(rollout.sequences, rollout.prompt_lens.tolist(), references,
                                                           reward_kwargs):
            prompt = decode(sequence[:prompt_len], skip_special_tokens=True)
            response = decode(sequence[prompt_len:], skip_special_tokens=True)
            scores.append(float(self.function(prompt, response, reference, **kwargs)))
        return torch.tensor(scores)


class RewardForward(Stage):
    def __init__(self, job: JobContext):
        self.job = job

    def setup(self, ctx: StageContext) -> None:
        super().setup(ctx)
        self.scorer = Scorer(self.job)
        process = self.job.config.reward.process
        self.process = ProcessScorer(process, self.scorer.tokenizer) if process is not None else None

    def step(self, batch: Batch | None) -> list[Output]:
        rollout = Rollout.from_tensors(batch.tensors)
        references = batch.metadata["references"]
        reward_kwargs = [json.loads(text) for text in batch.metadata[REWARD_KWARGS]]
        tensors = {"scores": self.scorer.score(rollout, references, reward_kwargs)}
        if self.process is not None:
            policy = unragged(batch.tensors, "loss_mask") if "loss_mask" in batch.tensors else None  # an env's
            tensors.update(ragged("process_rewards", self.process.rewards(rollout, references, policy)))
        return [topic_output("reward", tensors, batch.num_samples)]
