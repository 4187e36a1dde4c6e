"""One iteration's experience, assembled from the joined handles for the trainers.

    exp = Experience.from_batches(batches)       # every mini-batch of the iteration
    rewards = exp.token_rewards(kl_coef, cfg.kl) # (N, R): score on the last token, step rewards, KL penalty
    part = exp.select(indices)                   # the samples of one optimizer step

Per-token tensors are right-padded to (N, R) with `mask` marking the tokens the losses train on:
every response token of a single-turn sample; only the policy's tokens of an episode (the rollout
handle's `loss_mask`: observation tokens are 0, like padding; none of an episode whose handle field
`trained` is False: env.failed_episodes=mask). Every loss, the KL, the advantage
estimators, whitening and the metrics read per-token values only where `mask` is set, so whatever
sits at an observation position (log-probs, values) is never used. The sequences themselves stay
ragged (they are packed again for each forward pass).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch
from torch import Tensor

from stream_rlhf.algos.config import KLConfig
from stream_rlhf.algos.kl import kl_estimate
from stream_rlhf.device_copy import to_device
from stream_rlhf.envs.episode import OBSERVATION_VERSION
from stream_rlhf.samples import Rollout, SampleImages, pad_right, unragged
from stream_rlhf.stage import Batch


@dataclass
class Experience:
    sequences: list[Tensor]
    """(P_i + R_i,) token ids."""
    prompt_lens: Tensor
    """(N,)"""
    mask: Tensor
    """(N, R) 1.0 on the tokens trained on: response tokens, observation tokens of an episode left out."""
    behavior_logp: Tensor
    """(N, R) under the policy that sampled them."""
    old_logp: Tensor | None
    """(N, R) under the actor forward's (proximal) weights; None when the dataflow has no actor
    forward (`rl/dataflow.left_out_stages`: actor_train then gets them itself)."""
    ref_logp: Tensor | None
    """(N, R) under the reference policy; None when the dataflow has no reference (no KL)."""
    values: Tensor | None
    """(N, R) from the critic forward; None without a critic."""
    scores: Tensor
    """(N,) sequence rewards."""
    group_ids: Tensor
    """(N,)"""
    policy_versions: Tensor
    """(N,) the version that generated each sample."""
    images: list[SampleImages] | None = None
    """Each sample's image features (vision-language models)."""
    process_rewards: Tensor | None = None
    """(N, R) weighted step rewards at each step's end token (`reward.process`); None without."""
    env_rewards: Tensor | None = None
    """(N, R) an episode's per-turn rewards on each turn's last policy token (`env`); None without."""
    token_versions: Tensor | None = None
    """(N, R) long: the policy version that sampled each token, -1 on observations and padding;
    None when the rollout handle has none (single-turn without in-flight weight updates)."""
    truncated: Tensor | None = None
    """(N,) bool: cut by the length limit (a response at rollout.max_new_tokens without a stop, an
    episode ended by env.max_episode_tokens); None when no rollout handle says."""

    @classmethod
    def from_batches(cls, batches: list[Batch], images: list[list[SampleImages] | None] | None = None) -> Experience:
        """The experience of `batches`; `images` holds each batch's per-sample image features."""
        sequences, prompt_lens, behavior, old, ref, values, scores, groups, versions, process = ([] for _ in range(10))
        masks, env, token_versions, truncated = [], [], [], []
        for batch in batches:
            t = batch.tensors
            rollout = Rollout.from_tensors(t)
            sequences += rollout.sequences
            prompt_lens.append(rollout.prompt_lens)
            behavior += rollout.behavior_logp
            ones = "loss_mask" not in t  # single-turn: every response token is trained on
            own = [torch.ones(len(b)) for b in rollout.behavior_logp] if ones else unragged(t, "loss_mask")
            trained = t["trained"].tolist() if "trained" in t else [True] * len(own)  # env.failed_episodes
            masks += [m if keep else torch.zeros_like(m) for m, keep in zip(own, trained, strict=True)]
            if "env_rewards" in t:
                env += unragged(t, "env_rewards")
            if "token_versions" in t:
                token_versions += unragged(t, "token_versions")
            truncated.append(t["truncated"] if "truncated" in t else torch.zeros(batch.num_samples, dtype=torch.bool))
            if "old_logp" in t:
                old += unragged(t, "old_logp")
            if "ref_logp" in t:
                ref += unragged(t, "ref_logp")
            if "values" in t:
                values += unragged(t, "values")
            scores.append(t["scores"])
            if "process_rewards" in t:
                process += unragged(t, "process_rewards")
            groups.append(rollout.group_ids)
            versions.append(torch.full((batch.num_samples,), batch.policy_version))
        return cls(
            sequences=sequences,
            prompt_lens=torch.cat(prompt_lens),
            mask=pad_right([m.float() for m in masks], 0.0),
            behavior_logp=pad_right(behavior, 0.0),
            old_logp=pad_right(old, 0.0) if old else None,
            ref_logp=pad_right(ref, 0.0) if ref else None,
            values=pad_right(values, 0.0) if values else None,
            scores=torch.cat(scores).float(),
            group_ids=torch.cat(groups).long(),
            policy_versions=torch.cat(versions),
            images=[im for per_batch in images for im in per_batch] if images and images[0] is not None else None,
            process_rewards=pad_right(process, 0.0) if process else None,
            env_rewards=pad_right(env, 0.0) if env else None,
            token_versions=pad_right([v.long() for v in token_versions], OBSERVATION_VERSION) if token_versions
            else None,
            truncated=torch.cat(truncated).bool() if any("truncated" in b.tensors for b in batches) else None,
        )

    @property
    def num_samples(self) -> int:
        return len(self.sequences)

    @property
    def num_tokens(self) -> int:
        return sum(len(s) for s in self.sequences)

    def kl(self, kind: str) -> Tensor:
        """(N, R) per-token KL estimate of the sampling-time actor against the reference: the actor
        forward's log-probs (same weights, the trainer's precision) or, without an actor forward,
        the behaviour log-probs of the sampler. Zeros without a reference: the job has no KL."""
        if self.ref_logp is None:
            return torch.zeros_like(self.mask)
        actor = self.behavior_logp if self.old_logp is None else self.old_logp
        return torch.where(self.mask.bool(), kl_estimate(actor, self.ref_logp, kind), 0.0)

    def token_rewards(self, kl_coef: float, kl: KLConfig) -> Tensor:
        """(N, R): the score on each sample's last trained token (an episode's last policy token),
        plus the step rewards at their steps' end tokens (`reward.process`) and an episode's turn
        rewards at its turns' last tokens (`env_rewards`), minus kl_coef * KL per token when the KL
        penalty goes in the reward. A sample without a trained token gets none of them."""
        valid = self.mask.bool()
        last = last_valid(valid)  # (N,)
        rows = torch.nonzero(last >= 0).flatten()
        rewards = torch.zeros_like(self.mask)
        rewards[rows, last[rows]] = self.scores[rows]
        for per_token in (self.process_rewards, self.env_rewards):
            if per_token is not None:
                rewards = rewards + torch.where(valid, per_token, 0.0)
        if kl.placement == "reward":
            rewards = rewards - kl_coef * self.kl(kl.kind)
        return rewards

    def sample_returns(self) -> Tensor:
        """(N,) each sample's reward as a metric: its score, plus an episode's turn rewards (the
        episode's return: score + sum of env_rewards)."""
        if self.env_rewards is None:
            return self.scores
        return self.scores + self.env_rewards.sum(dim=1)

    def padded(self, per_sample: list[Tensor]) -> Tensor:
        """(N, R) from per-sample response values, padded to this experience's width."""
        out = pad_right(per_sample, 0.0)
        return torch.nn.functional.pad(out, (0, self.mask.shape[1] - out.shape[1]))

    def to(self, device: torch.device, keep_on_host: tuple[str, ...] = ()) -> Experience:
        """The same samples with every tensor on `device` (`to_device`; image features move when
        fed), except the fields named in `keep_on_host`."""
        moved = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in keep_on_host:
                moved[f.name] = value
            elif isinstance(value, Tensor):
                moved[f.name] = to_device(value, device)
            elif f.name == "sequences":
                moved[f.name] = [to_device(s, device) for s in value]
            else:
                moved[f.name] = value
        return Experience(**moved)

    def without_loss_on(self, rows: Tensor) -> Experience:
        """This experience with no token of the samples where `rows` (N,) is True trained on (their
        mask 0); everything else shared."""
        return replace(self, mask=self.mask * (~rows.bool()).to(self.mask.dtype)[:, None])

    def select(self, index: Tensor) -> Experience:
        """The samples at `index` (an optimizer step's share)."""
        picked = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, list):
                picked[f.name] = [value[i] for i in index.tolist()]
            elif value is None:
                picked[f.name] = None
            else:
                picked[f.name] = value[index]
        return Experience(**picked)


def last_valid(valid: Tensor) -> Tensor:
    """(N,) long: the position of each row's last True of `valid` (N, R); -1 for a row without one."""
    positions = torch.arange(1, valid.shape[1] + 1, device=valid.device)  # 1-based; 0 = none
    ends = torch.where(valid, positions, 0)
    return torch.cat([torch.zeros_like(ends[:, :1]), ends], dim=1).amax(dim=1) - 1


class IterationBuffer:
    """Collects experience mini-batches by iteration; a trainer takes an iteration once all of
    its mini-batches are in (later iterations wait here while rollout runs ahead)."""

    def __init__(self, minibatches: int):
        self.minibatches = minibatches
        self.pending: dict[int, list[Batch]] = {}

    def add(self, batch: Batch) -> None:
        self.pending.setdefault(batch.iteration, []).append(batch)

    def completes(self, batch: Batch, iteration: int) -> bool:
        """Whether adding `batch` makes `iteration` complete (the step that trains on it)."""
        have = len(self.pending.get(iteration, ())) + (batch.iteration == iteration)
        return have >= self.minibatches

    def take(self, iteration: int) -> list[Batch] | None:
        if len(self.pending.get(iteration, ())) < self.minibatches:
            return None
        return sorted(self.pending.pop(iteration), key=lambda b: b.minibatch)

    def take_newest(self) -> tuple[list[Batch], int] | None:
        """The newest complete iteration and how many older ones were dropped to get to it
        (a consumer that may fall behind and only wants the freshest data); None while no
        iteration is complete."""
        complete = [i for i, batches in self.pending.items() if len(batches) >= self.minibatches]
        if not complete:
            return None
        newest = max(complete)
        older = [i for i in self.pending if i < newest]
        for iteration in older:
            del self.pending[iteration]
        return self.take(newest), len(older)

