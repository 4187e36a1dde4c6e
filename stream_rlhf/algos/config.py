"""Config of the RL algorithm (`algorithm`: advantage estimator, PPO clipping, epochs, and its
`kl` penalty), beside the math it selects (`advantages.py`, `losses.py`, `kl.py`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Literal

from msgspec import Meta

from stream_rlhf.algos.advantages import ADVANTAGE_ESTIMATORS, NEEDS_CRITIC
from stream_rlhf.algos.aggregation import LossAggregation
from stream_rlhf.config import ConfigError, check_fields

Estimator = Literal["gae", "grpo", "rloo", "reinforce_pp"]


@dataclass(frozen=True)
class KLConfig:
    """The KL(policy || reference) penalty that keeps the policy near the starting checkpoint
    (`algos/kl.py`); the `ref_forward` stage computes the reference log-probs it needs."""

    kind: Literal["k1", "k2", "k3"] = "k1"
    """The per-token KL estimator: `k1` = logp - ref_logp (unbiased, high variance, can be
    negative), `k2` = 0.5 * (logp - ref_logp)^2 (low variance, biased), `k3` = exp(d) - d - 1 with
    d = ref_logp - logp (unbiased, low variance, never negative)."""
    placement: Literal["reward", "loss"] = "reward"
    """`reward`: -coef * KL per token is added to the reward; `loss`: coef * KL is added to the loss."""
    coef: Annotated[float, Meta(ge=0)] = 0.01
    """The KL coefficient (the starting one when `target` is set). 0 with no `target`: no KL
    penalty, and the job runs without a `ref_forward` stage."""
    target: Annotated[float, Meta(gt=0)] | None = None
    """Set to make the coefficient adaptive (Ziegler et al.): it moves to keep KL near target."""
    horizon: Annotated[int, Meta(ge=1)] = 10_000
    """Adaptive coefficient only: each update moves it by at most 20% times (samples measured /
    horizon); larger is slower."""
    reference: Literal["ref_forward", "lora_base"] = "ref_forward"
    """Where the reference log-probs come from: `ref_forward`, a stage holding the starting
    checkpoint; `lora_base` (with actor.lora, no critic): the actor's own model with its adapters
    off, which is the starting checkpoint, computed by actor_train once per iteration. The job then
    runs no ref_forward stage: one model copy and process fewer, one forward more in the trainer."""

    def __post_init__(self) -> None:
        check_fields(self)


@dataclass(frozen=True)
class DynamicSamplingConfig:
    """DAPO's dynamic sampling (`algos/group_filter.py`): the groups whose returns are all equal
    (every answer right, or every one wrong) give no policy gradient and are left out of training,
    counted in summary.json's `dropped_reasons`."""

    groups: Annotated[int, Meta(ge=1)] | None = None
    """Groups trained per iteration: the first this many informative ones, in mini-batch order; the
    later informative ones are left out as surplus. Over-sample by generating more prompts per
    iteration than this (rollout_batch.prompts_per_minibatch x minibatches), as DAPO fills a fixed
    batch of informative groups; an iteration that finds fewer trains those (metric `groups_short`).
    None: every informative group trains."""

    def __post_init__(self) -> None:
        check_fields(self)


@dataclass(frozen=True)
class AlgorithmConfig:
    """The advantage estimator and the PPO loss (`algos/advantages.py`, `algos/losses.py`)."""

    advantage: Estimator = "gae"
    """How advantages are estimated: `gae` (generalised advantage estimation with a learned critic:
    the critic stages run), `grpo` (each response's score normalised over its prompt's group),
    `rloo` (score minus the mean of the other responses to its prompt), `reinforce_pp` (REINFORCE++:
    discounted returns; whitened over the batch when whiten_advantages). grpo and rloo need
    rollout_batch.samples_per_prompt >= 2; only gae uses a critic."""
    gamma: Annotated[float, Meta(ge=0, le=1)] = 1.0
    """Discount factor per token of the return (gae, reinforce_pp); 1: no discount, the usual
    choice when the reward sits on the last token."""
    lam: Annotated[float, Meta(ge=0, le=1)] = 0.95
    """GAE's lambda (gae only): 1 is the Monte Carlo return (high variance), 0 the one-step TD
    estimate (biased by the critic)."""
    clip_low: Annotated[float, Meta(ge=0, lt=1)] = 0.2
    """PPO's clip below: the probability ratio is clipped at 1 - clip_low."""
    clip_high: Annotated[float, Meta(ge=0)] = 0.2
    """PPO's clip above: the ratio is clipped at 1 + clip_high (larger than clip_low: "clip-higher",
    more room to raise unlikely tokens)."""
    ratio_level: Literal["token", "sequence"] = "token"
    """The probability ratio the actor's loss clips: `token` (PPO's, one per token) or `sequence`
    (GSPO: one per sample, the geometric mean of its tokens' ratios, so a sample is clipped as a whole
    and one odd token cannot dominate its update; the GSPO paper uses clip_low 3e-4, clip_high 4e-4
    and loss_aggregation sequence_mean)."""
    value_clip: Annotated[float, Meta(ge=0)] = 0.2
    """gae: the critic's new values are clipped to within this of the values it predicted when the
    iteration's experience was made (the clipped value loss)."""
    is_cap: Annotated[float, Meta(ge=1)] = 2.0
    """Decoupled PPO (overlap_depth >= 1): each token's loss is weighted by exp(old_logp -
    behavior_logp), the proximal over the behaviour policy, truncated to at most is_cap, which
    bounds how much a token sampled by an older version counts."""
    sampler_correction: bool = False
    """overlap_depth 0: weight each token by exp(proximal - behaviour log-prob) truncated at is_cap,
    as decoupled PPO does with rollout ahead: corrects the gap between the sampler's numerics and
    the trainer's (vLLM, bf16, static or graph decode: truncated importance sampling, TRL's
    vllm_importance_sampling_correction). With overlap_depth >= 1 every token is weighted anyway."""
    entropy_coef: Annotated[float, Meta(ge=0)] = 0.0
    """Weight of the entropy bonus in the actor's loss (loss - entropy_coef * entropy); 0: no bonus
    (the entropy is logged either way)."""
    whiten_advantages: bool = True
    """Whiten over the whole rollout batch (every mini-batch of the iteration)."""
    group_std: bool = True
    """grpo only: divide each response's centred score by its group's std; false: centre only (Dr.
    GRPO: no question counts more for having a small spread; set whiten_advantages false too, or the
    batch's std scales them again)."""
    loss_aggregation: LossAggregation = "token_mean"
    """How the actor's per-token losses (policy, KL in the loss, entropy bonus) become one, over an
    optimizer step's samples: `token_mean` (each token counts the same: a long answer weighs more),
    `sequence_mean` (each sample counts the same: the mean of its tokens, then of the samples),
    `token_sum` (each sample's token sum over the response budget, rollout.max_new_tokens or with an
    env env.max_episode_tokens, then the mean over samples: Dr. GRPO's, no length bias). The
    critic's value loss stays a token mean (`algos/aggregation.py`)."""
    mask_truncated: bool = False
    """Leave the responses cut by their length limit out of the actor's loss (DAPO's overlong
    filtering): a response at rollout.max_new_tokens without a stop, an episode ended by
    env.max_episode_tokens. Their tokens carry no policy loss, KL or entropy; their scores still
    count in the advantages (a group's mean and std), and the critic still trains on them."""
    dynamic_sampling: DynamicSamplingConfig | None = None
    """Train only on groups whose returns differ (DAPO's dynamic sampling, verl's filter_groups;
    grpo and rloo): `{}` leaves out the groups of equal returns, `{groups: N}` also trains at most N
    groups per iteration. None: every sample trains."""
    ppo_epochs: Annotated[int, Meta(ge=1)] = 2
    """Passes of the actor (and critic) over each iteration's samples."""
    train_minibatches: Annotated[int, Meta(ge=1)] = 2
    """Optimizer steps per epoch: the iteration's samples are split into this many."""
    kl: KLConfig = field(default_factory=KLConfig)
    """The KL penalty against the reference model (`algorithm.kl`)."""

    def __post_init__(self) -> None:
        check_fields(self)
        if self.advantage not in ADVANTAGE_ESTIMATORS:
            raise ConfigError(f"advantage={self.advantage!r}: unknown")

    @property
    def uses_critic(self) -> bool:
        return self.advantage in NEEDS_CRITIC
