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

With `reward.workers` the function (and `reward.process.function`) runs in processes of its own,
several samples at once, each call bounded by `reward.timeout_s` (`rl/reward_pool.py`); the calls
that time out score `reward.timeout_score` and are counted (the stage count `reward_timeouts`, in
summary.json).
"""

from __future__ import annotations

import json
from collections.abc import Callable

import torch

from stream_rlhf.backends.forward_engine import RewardModelEngine
from stream_rlhf.config import import_dotted
from stream_rlhf.data.tokenizer import load_tokenizer
from stream_rlhf.rl.reward_pool import OUTCOME, RewardPool, log_timeouts
from stream_rlhf.samples import Rollout, ragged, unragged
from stream_rlhf.stage import Batch, Output, Stage, StageContext
from stream_rlhf.stages.job_context import JobContext, stage_counts
from stream_rlhf.stages.process_reward import ProcessScorer
from stream_rlhf.stages.topics import REWARD_KWARGS, topic_output

RewardFunction = Callable[..., float]


class Scorer:
    """The configured reward: rule-based function, reward model, or both (also used by evaluation).
    With `reward.workers` the function runs in a `RewardPool`; `close()` ends its processes."""

    def __init__(self, job: JobContext, process_rule: bool = False):
        """`process_rule`: `reward.workers` run `reward.process.function` too (the reward stage's
        `ProcessScorer` uses `pool`); evaluation scores outcomes only."""
        self.cfg = job.config.reward
        self.tokenizer = load_tokenizer(job.checkpoint)
        self.function: RewardFunction | None = (
            import_dotted(self.cfg.function, "reward.function") if self.cfg.function else None)
        functions = {kind: path for kind, path in self.cfg.pooled_functions().items()
                     if process_rule or kind == OUTCOME}
        self.pool = (RewardPool(functions, self.cfg.workers, self.cfg.timeout_s, self.cfg.timeout_score)
                     if self.cfg.workers and functions else None)
        self.timeouts = 0
        """Calls of the function that ran past reward.timeout_s (scored reward.timeout_score)."""
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
        calls = [(decode(sequence[:prompt_len], skip_special_tokens=True),
                  decode(sequence[prompt_len:], skip_special_tokens=True), reference, kwargs)
                 for sequence, prompt_len, reference, kwargs in zip(rollout.sequences, rollout.prompt_lens.tolist(),
                                                                    references, reward_kwargs)]
        if self.pool is None:
            return torch.tensor([float(self.function(*call[:3], **call[3])) for call in calls])
        scores, timeouts = self.pool.run(OUTCOME, calls)
        self.timeouts += log_timeouts(timeouts)
        return torch.tensor(scores)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()

    def __enter__(self) -> Scorer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class RewardForward(Stage):
    def __init__(self, job: JobContext):
        self.job = job

    def setup(self, ctx: StageContext) -> None:
        super().setup(ctx)
        self.scorer = Scorer(self.job, process_rule=True)
        self.counts = stage_counts(self.job, ctx)
        process = self.job.config.reward.process
        self.process = ProcessScorer(process, self.scorer.tokenizer, self.scorer.pool) if process is not None else None

    def step(self, batch: Batch | None) -> list[Output]:
        rollout = Rollout.from_tensors(batch.tensors)
        references = batch.metadata["references"]
        reward_kwargs = [json.loads(text) for text in batch.metadata[REWARD_KWARGS]]
        timeouts = self._timeouts()
        tensors = {"scores": self.scorer.score(rollout, references, reward_kwargs)}
        if self.process is not None:
            policy = unragged(batch.tensors, "loss_mask") if "loss_mask" in batch.tensors else None  # an env's
            tensors.update(ragged("process_rewards", self.process.rewards(rollout, references, policy)))
        if self._timeouts() > timeouts:
            self.counts.add(reward_timeouts=self._timeouts() - timeouts)
        return [topic_output("reward", tensors, batch.num_samples)]

    def _timeouts(self) -> int:
        """Reward calls past reward.timeout_s so far, the outcome's and the process rule's."""
        return self.scorer.timeouts + (self.process.timeouts if self.process is not None else 0)

    def close(self) -> None:
        if hasattr(self, "scorer"):  # a setup that failed may not have made it
            self.scorer.close()
