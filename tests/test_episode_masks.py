"""Multi-turn episodes downstream of rollout: a scripted environment's episodes become a rollout
handle (`envs/episode_handle.py`), then experience, rewards, every advantage estimator, the KL and
the losses. Only policy tokens carry loss, KL and advantages; whatever sits at an observation
position (behaviour, old and reference log-probs, values) is never used, and the gradient of the
observation positions' logits is exactly 0; turn rewards land on turn ends."""

from __future__ import annotations

import math

import pytest
import torch

from stream_rlhf.algos.advantages import ADVANTAGE_ESTIMATORS
from stream_rlhf.algos.config import KLConfig
from stream_rlhf.algos.losses import entropy_loss, kl_loss, policy_loss, value_loss
from stream_rlhf.algos.masked import masked_whiten
from stream_rlhf.broker.control.messages import Handle
from stream_rlhf.envs.environment import EpisodeStart, Observation, Turn
from stream_rlhf.envs.episode import OBSERVATION_VERSION, Episode, limit_reached
from stream_rlhf.envs.episode_handle import episode_tensors
from stream_rlhf.experience import Experience
from stream_rlhf.samples import Rollout, pad_right, ragged, unragged
from stream_rlhf.stage import Batch
from stream_rlhf.stages.actor_train import ActorTrain
from stream_rlhf.stages.topics import topic_output

VOCAB = 32
START = EpisodeStart(prompt="2+3=", reference="5")
SCORES = torch.tensor([1.0, 0.0, 0.5, -1.0])
GROUPS = torch.tensor([0, 0, 1, 1])


class Scripted:
    """A tool whose answers to the policy's turns are scripted: (observation text or None, reward, done)."""

    def __init__(self, replies: list[tuple[str | None, float, bool]]):
        self.replies = replies

    def reset(self, start: EpisodeStart) -> None:
        self.turn = 0

    def step(self, text: str, token_ids: list[int]) -> Turn:
        text, reward, done = self.replies[self.turn]
        self.turn += 1
        return Turn(Observation(text) if text is not None else None, reward=reward, done=done)


def observation_ids(text: str) -> list[int]:
    return [3 + ord(c) % 20 for c in text]


def play(env: Scripted, prompt: list[int], turns: list[tuple[list[int], int]], max_tokens: int = 64) -> Episode:
    """An episode as an engine runs one: each scripted policy turn (ids, policy version; log-probs
    made up), the env's answer appended as an observation, until done or a limit."""
    episode = Episode(prompt_ids=prompt)
    env.reset(START)
    for ids, version in turns:
        episode.add_policy_turn(ids, [-0.1 * (k + 1) for k in range(len(ids))], policy_version=version)
        turn = env.step(" ".join(map(str, ids)), ids)
        episode.set_turn_reward(turn.reward)
        if turn.observation is not None:
            episode.add_observation(observation_ids(turn.observation.text))
        if turn.done or limit_reached(episode, max_turns=8, max_episode_tokens=max_tokens):
            break
    return episode


def episodes() -> list[Episode]:
    """Two groups of two: two turns; three turns; one turn and no observation (single-turn-like);
    a turn whose long observation hits the token limit (the episode ends on an observation)."""
    return [
        play(Scripted([("=5", 0.25, False), (None, 1.0, True)]), [1, 5, 6], [([10, 11, 2], 3), ([12, 2], 4)]),
        play(Scripted([("=12 ok", 0.0, False), ("x", -0.5, False), (None, 0.5, True)]), [1, 5, 6],
             [([13, 2], 4), ([14, 15, 2], 4), ([16, 2], 4)]),
        play(Scripted([(None, 0.0, True)]), [1, 7], [([17, 18, 19, 2], 4)]),
        play(Scripted([("=a long observation", 0.1, False)]), [1, 7], [([20, 2], 3), ([21, 2], 3)], max_tokens=12),
    ]


def rollout_handle() -> dict[str, torch.Tensor]:
    tensors = {**episode_tensors(episodes()), "group_ids": GROUPS}
    topic_output("rollout", tensors, len(GROUPS))  # the handle the rollout topic's schema accepts
    return tensors


def experience(fill: float, seed: int = 0) -> Experience:
    """The joined experience of the episodes: random log-probs and values on policy tokens, `fill`
    at every observation position (behaviour, old and reference log-probs, values)."""
    t = rollout_handle()
    g = torch.Generator().manual_seed(seed)
    masks = unragged(t, "loss_mask")

    def per_token(name: str, scale: float) -> dict[str, torch.Tensor]:
        values = [torch.where(m, -scale * torch.rand(len(m), generator=g), fill) for m in masks]
        return ragged(name, values)

    joined = {**t, **per_token("behavior_logp", 2.0), **per_token("old_logp", 2.0), **per_token("ref_logp", 2.0),
              **per_token("values", -1.0), "scores": SCORES}
    return Experience.from_batches([Batch(Handle("h0", "experience", 0, 0, 4, len(GROUPS)), joined)])


def test_the_rollout_handle_of_episodes_follows_the_contract():
    t = rollout_handle()
    first = episodes()[0]
    assert t["sequences"].dtype == torch.long and t["prompt_lens"].tolist() == [3, 3, 2, 2]
    assert unragged(t, "sequences")[0].tolist() == [1, 5, 6, 10, 11, 2, *observation_ids("=5"), 12, 2]
    assert unragged(t, "loss_mask")[0].tolist() == [True] * 3 + [False] * 2 + [True] * 2
    assert t["loss_mask"].dtype == torch.bool and t["env_rewards"].dtype == torch.float32
    assert unragged(t, "env_rewards")[0].tolist() == [0, 0, 0.25, 0, 0, 0, 1.0]
    assert unragged(t, "behavior_logp")[0].tolist() == pytest.approx([-0.1, -0.2, -0.3, 0, 0, -0.1, -0.2])
    assert t["token_versions"].dtype == torch.int32
    assert unragged(t, "token_versions")[0].tolist() == [3, 3, 3, OBSERVATION_VERSION, OBSERVATION_VERSION, 4, 4]
    for name in ("behavior_logp", "loss_mask", "env_rewards", "token_versions"):  # R_i: every token after the prompt
        assert t[f"{name}_lens"].tolist() == [len(e.token_ids) for e in episodes()], name
    assert first.turn_ends == [2, 6]


def test_turn_rewards_land_on_turn_ends_and_the_score_on_the_last_policy_token():
    exp = experience(0.0)
    assert torch.equal(exp.mask.bool(), pad_right(unragged(rollout_handle(), "loss_mask"), False))
    rewards = exp.token_rewards(0.0, KLConfig(coef=0.0))
    placed = {i: {j: rewards[i, j].item() for j in torch.nonzero(rewards[i]).flatten().tolist()} for i in range(4)}
    assert placed[0] == {2: 0.25, 6: 1.0 + 1.0}  # turn 1's reward; turn 2's reward + the score
    assert placed[1] == {10: -0.5, 13: 0.5}  # turn 1 (reward 0) carries nothing, the score is 0
    assert placed[2] == {3: 0.5}
    assert placed[3] == pytest.approx({1: 0.1 - 1.0})  # ends on an observation: the score stays on a policy token
    assert not (exp.mask[3, 2:]).any() and exp.token_versions[3, 2:].eq(OBSERVATION_VERSION).all()
    assert exp.sample_returns().tolist() == pytest.approx([2.25, 0.0, 0.5, -0.9])
    metrics = ActorTrain._reward_metrics(exp)  # the trainer's reward: the mean episode return, and its parts
    assert metrics == pytest.approx({"reward": 0.4625, "score": 0.125, "env_reward": 0.3375}, abs=1e-4)


def test_an_episode_not_trained_carries_no_token_of_loss_reward_or_advantage():
    """env.failed_episodes=mask: the rollout handle's `trained` False for episode 1; its row of the
    mask is empty, so it gets no reward, KL or advantage, and its group is episode 0 alone."""
    t = {**rollout_handle(), "trained": torch.tensor([True, False, True, True])}
    topic_output("rollout", t, len(GROUPS))
    masks = unragged(t, "loss_mask")
    joined = {**t, **ragged("behavior_logp", [torch.where(m, -0.5, 0.0) for m in masks]), "scores": SCORES}
    exp = Experience.from_batches([Batch(Handle("h0", "experience", 0, 0, 4, len(GROUPS)), joined)])
    assert not exp.mask[1].any() and torch.equal(exp.mask[0].bool(), pad_right(masks, False)[0])
    rewards = exp.token_rewards(0.0, KLConfig(coef=0.0))
    assert not rewards[1].any() and rewards[0].any()
    advantages, _ = ADVANTAGE_ESTIMATORS["grpo"](rewards, exp.mask, None, exp.group_ids, 1.0, 1.0)
    assert not advantages[1].any() and not advantages[0].any()  # a group of one member: advantage 0


def outputs(exp: Experience, logits: torch.Tensor) -> dict[str, torch.Tensor]:
    """Everything the trainers compute from `exp` and the policy's `logits` (N, R, V) at the
    response positions: KL, rewards, each estimator's advantages and returns, the losses."""
    out = {"kl_k1": exp.kl("k1"), "kl_k3": exp.kl("k3")}
    kl = KLConfig(kind="k3", coef=0.1)
    rewards = exp.token_rewards(0.1, kl)
    out["rewards"] = rewards
    for name, estimator in ADVANTAGE_ESTIMATORS.items():
        advantages, returns = estimator(rewards, exp.mask, exp.values, exp.group_ids, 0.9, 0.8)
        out[f"{name}_advantages"], out[f"{name}_returns"] = advantages, returns
        out[f"{name}_whitened"] = masked_whiten(advantages, exp.mask)
    tokens = pad_right([s[p:] for s, p in zip(exp.sequences, exp.prompt_lens.tolist())], 0)  # (N, R)
    log_probs = torch.log_softmax(logits, dim=-1)
    logp = log_probs.gather(-1, tokens[..., None]).squeeze(-1)  # (N, R)
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    advantages = out["gae_whitened"]
    pg, metrics = policy_loss(logp, exp.old_logp, advantages, exp.mask, 0.2, 0.28, exp.behavior_logp, is_cap=2.0)
    pg = pg + policy_loss(logp, exp.old_logp, advantages, exp.mask, 0.2, 0.28)[0]  # coupled (overlap_depth 0)
    kl_term = sum(kl_loss(logp, exp.ref_logp, exp.mask, kind)[0] for kind in ("k1", "k2", "k3"))
    ent_term, ent = entropy_loss(entropy, exp.mask)
    values = (logits[..., 0] * 0.5).float()  # a value head's output, gradient flowing into the logits
    v_loss, v_metrics = value_loss(values, exp.values, out["gae_returns"], exp.mask, 0.2)
    loss = pg + 0.1 * kl_term + 0.01 * ent_term + v_loss
    loss.backward()
    out.update(loss=loss.detach(), **{k: v.detach() for k, v in {**metrics, **ent, **v_metrics}.items()})
    return out


@pytest.mark.parametrize("fill", [math.nan, math.inf, -1e30, 1e30])
def test_nothing_at_observation_positions_is_used(fill):
    g = torch.Generator().manual_seed(1)
    clean, dirty = experience(0.0), experience(fill)
    shape = (*clean.mask.shape, VOCAB)
    base = torch.randn(shape, generator=g)
    logits = {key: base.clone().requires_grad_() for key in ("clean", "dirty")}
    got = {"clean": outputs(clean, logits["clean"]), "dirty": outputs(dirty, logits["dirty"])}
    response_lens = torch.tensor([len(s) - p for s, p in zip(clean.sequences, clean.prompt_lens.tolist())])
    observation = ~clean.mask.bool() & (torch.arange(clean.mask.shape[1]) < response_lens[:, None])  # (N, R)
    assert observation.sum() == len("=5") + len("=12 ok") + len("x") + len("=a long observation")
    assert (clean.token_versions[observation] == OBSERVATION_VERSION).all()
    for name, value in got["clean"].items():
        assert torch.isfinite(got["dirty"][name]).all(), name
        assert torch.equal(value, got["dirty"][name]), name
        if value.shape == clean.mask.shape:
            assert (value[observation] == 0).all(), f"{name} at observation positions"
    for key in logits:
        grad = logits[key].grad
        assert torch.isfinite(grad).all()
        assert (grad[observation] == 0).all()  # exactly 0, not small
        assert (grad[clean.mask.bool()].abs().sum(-1) > 0).all()  # every policy token is trained on
    assert torch.equal(logits["clean"].grad, logits["dirty"].grad)


@pytest.mark.parametrize("name", sorted(ADVANTAGE_ESTIMATORS))
def test_advantages_of_an_episode_are_those_of_its_policy_tokens_alone(name):
    """Observation tokens are passed over: GAE's and REINFORCE++'s "next token" is the next policy
    token, so an episode's advantages equal those of its policy tokens joined without them."""
    exp = experience(0.0)
    rewards = exp.token_rewards(0.1, KLConfig(kind="k1", coef=0.1))
    valid = exp.mask.bool()

    def squeeze(x: torch.Tensor) -> torch.Tensor:  # (N, R) -> (N, policy tokens)
        return pad_right([row[keep] for row, keep in zip(x, valid)], 0.0)

    squeezed_mask = pad_right([torch.ones(int(keep.sum())) for keep in valid], 0.0)
    estimator = ADVANTAGE_ESTIMATORS[name]
    advantages, returns = estimator(rewards, exp.mask, exp.values, exp.group_ids, 0.9, 0.8)
    alone_advantages, alone_returns = estimator(squeeze(rewards), squeezed_mask, squeeze(exp.values), exp.group_ids,
                                                0.9, 0.8)
    assert torch.allclose(squeeze(advantages), alone_advantages, atol=1e-6)
    assert torch.allclose(squeeze(returns), alone_returns, atol=1e-6)
    assert advantages[valid].abs().sum() > 0


def test_a_truncated_episode_counts_in_its_groups_advantages_but_carries_no_loss():
    """algorithm.mask_truncated: episode 1 ended by env.max_episode_tokens (the handle's
    `truncated`). Its score still moves its group's advantages; once the actor leaves it out
    (`without_loss_on`), no token of it carries loss or gradient, and the others are unchanged."""
    t = {**rollout_handle(), "truncated": torch.tensor([False, True, False, False])}
    topic_output("rollout", t, len(GROUPS))
    masks = unragged(t, "loss_mask")
    joined = {**t, **ragged("behavior_logp", [torch.where(m, -0.5, 0.0) for m in masks]), "scores": SCORES}
    exp = Experience.from_batches([Batch(Handle("h0", "experience", 0, 0, 4, len(GROUPS)), joined)])
    assert exp.truncated.tolist() == [False, True, False, False] and exp.mask[1].any()
    advantages, _ = ADVANTAGE_ESTIMATORS["grpo"](exp.token_rewards(0.0, KLConfig(coef=0.0)), exp.mask, None,
                                                 exp.group_ids, 1.0, 1.0)
    assert advantages[0].any() and advantages[1].any()  # a group of two: each other's baseline
    trained = exp.without_loss_on(exp.truncated)
    assert not trained.mask[1].any() and all(torch.equal(trained.mask[i], exp.mask[i]) for i in (0, 2, 3))
    logp = exp.behavior_logp.clone().requires_grad_()
    loss, _ = policy_loss(logp, exp.behavior_logp, advantages, trained.mask, 0.2, 0.2)
    loss.backward()
    assert not logp.grad[1].any() and logp.grad[0].any()
    assert Experience.from_batches([Batch(Handle("h0", "experience", 0, 0, 4, len(GROUPS)),
                                          {k: v for k, v in joined.items() if k != "truncated"})]).truncated is None


def test_single_turn_handles_are_unchanged():
    """One-turn episodes without observations or turn rewards give the same experience, rewards
    and advantages as the single-turn handle without the episode fields."""
    plays = [play(Scripted([(None, 0.0, True)]), [1, 5], [(list(range(10, 10 + n)) + [2], 0)]) for n in (1, 3, 2, 4)]
    episode_handle = {**episode_tensors(plays), "group_ids": GROUPS}
    single = Rollout([torch.tensor(e.prompt_ids + e.token_ids) for e in plays],
                     torch.tensor([2] * 4, dtype=torch.int32),
                     [torch.tensor(e.behavior_logp) for e in plays], GROUPS).to_tensors()
    made = []
    for t in (episode_handle, single):
        ref = ragged("ref_logp", [torch.full((len(e.token_ids),), -0.5) for e in plays])
        values = ragged("values", [torch.linspace(0, 1, len(e.token_ids)) for e in plays])
        batch = Batch(Handle("h0", "experience", 0, 0, 0, 4), {**t, **ref, **values, "scores": SCORES})
        made.append(Experience.from_batches([batch]))
    episode_exp, single_exp = made
    assert single_exp.env_rewards is None and single_exp.token_versions is None
    assert torch.equal(episode_exp.mask, single_exp.mask)
    assert torch.equal(episode_exp.sample_returns(), single_exp.sample_returns())
    kl = KLConfig(coef=0.05)
    assert torch.equal(episode_exp.token_rewards(0.05, kl), single_exp.token_rewards(0.05, kl))
    for estimator in ADVANTAGE_ESTIMATORS.values():
        for a, b in zip(*(estimator(e.token_rewards(0.05, kl), e.mask, e.values, e.group_ids, 0.9, 0.8)
                          for e in made)):
            assert torch.equal(a, b)
