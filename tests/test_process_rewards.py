"""Process rewards: steps cut at the separator token, step scores placed on their end tokens,
combined with the outcome into the token rewards that GAE, REINFORCE++, GRPO and RLOO read
(checked against values computed by hand), and the config checks around them."""

from __future__ import annotations

import json
import random

import pytest
import torch

from stream_rlhf.algos.advantages import gae, grpo, reinforce_pp, rloo
from stream_rlhf.algos.config import KLConfig
from stream_rlhf.algos.process_rewards import place_step_rewards, step_ends, step_spans
from stream_rlhf.config import ConfigError, build
from stream_rlhf.data.arithmetic import final_reward, problems, reward, step_reward
from stream_rlhf.experience import Experience
from stream_rlhf.models.checkpoint import build_tiny, save_checkpoint
from stream_rlhf.models.model_config import TinyModelConfig
from stream_rlhf.models.prm import corrupted_steps, load_prm, train_tiny_prm
from stream_rlhf.models.tokenizer import build_tokenizer
from stream_rlhf.rl.config import RLJobConfig
from stream_rlhf.rl.reward_parts_config import ProcessRewardConfig
from stream_rlhf.rl.reward_pool import STEPS, RewardPool
from stream_rlhf.rl.task_data import check_prompts
from stream_rlhf.samples import Rollout, pad_right
from stream_rlhf.stages.process_reward import ProcessScorer, check_process_reward, separator_id

STEP_RULE = "stream_rlhf.data.arithmetic:step_reward"


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def ids(tokenizer, text: str, eos: bool = True) -> torch.Tensor:
    return torch.tensor(tokenizer.encode(text, add_special_tokens=False) + ([tokenizer.eos_token_id] if eos else []))


def test_steps_end_at_each_separator_and_at_the_last_token(tokenizer):
    sep = separator_id(tokenizer, ",")
    response = ids(tokenizer, "19,49")  # 1 9 , 4 9 <eos>
    assert step_ends(response, sep).tolist() == [2, 5]
    assert step_spans(response, step_ends(response, sep), sep) == [(0, 2), (3, 6)]
    assert step_ends(ids(tokenizer, "19,"), sep).tolist() == [2, 3]  # an empty final step (<eos> alone)
    assert step_ends(ids(tokenizer, "19,", eos=False), sep).tolist() == [2]  # cut off after a separator
    assert step_ends(ids(tokenizer, "7"), sep).tolist() == [1]  # no separator: one step
    assert place_step_rewards(torch.tensor([1.0, -2.0]), torch.tensor([2, 5]), 6).tolist() == [0, 0, 1, 0, 0, -2]
    with pytest.raises(ValueError, match="1 step scores for 2 steps"):
        place_step_rewards(torch.tensor([1.0]), torch.tensor([2, 5]), 6)


def test_in_an_episode_only_policy_tokens_make_steps_and_each_turn_ends_one(tokenizer):
    """"1,2<eos>" (policy) "=3,=4" (an observation: its separator ends nothing) "5,6" (policy, cut
    before an end token): steps 1 | 2<eos> | 5 | 6, none spanning the observation."""
    sep = separator_id(tokenizer, ",")
    turns = [("1,2", True, True), ("=3,=4", False, False), ("5,6", True, False)]
    response = torch.cat([ids(tokenizer, text, eos) for text, _, eos in turns])
    policy = torch.cat([torch.full((len(ids(tokenizer, text, eos)),), flag) for text, flag, eos in turns])
    ends = step_ends(response, sep, policy)
    assert ends.tolist() == [1, 3, 10, 11]  # the separators the policy wrote and each turn's last token
    spans = step_spans(response, ends, sep, policy)
    assert spans == [(0, 1), (2, 4), (9, 10), (11, 12)]
    assert [tokenizer.decode(response[a:b], skip_special_tokens=True) for a, b in spans] == ["1", "2", "5", "6"]
    assert torch.equal(step_ends(response, sep, torch.ones_like(policy)), step_ends(response, sep))


def test_the_rule_scorer_gets_an_episodes_policy_steps_only(tokenizer):
    scorer = ProcessScorer(build(ProcessRewardConfig, {"function": "tests.test_process_rewards:echo_steps",
                                                       "weight": 0.5}, "reward.process"), tokenizer)
    prompt = ids(tokenizer, "1+2+3=", eos=False)
    response = torch.cat([ids(tokenizer, "3,6", eos=False), ids(tokenizer, "=6,ok", eos=False), ids(tokenizer, "6")])
    policy = torch.tensor([True] * 3 + [False] * 5 + [True] * 2)
    rollout = Rollout([torch.cat([prompt, response])], torch.tensor([len(prompt)]), [torch.zeros(len(response))],
                      torch.zeros(1, dtype=torch.long))
    (rewards,) = scorer.rewards(rollout, ["6"], [policy])
    assert SEEN == [["3", "6", "6"]]  # no observation text among the steps
    assert rewards.tolist() == [0, 0.5, 0.5, 0, 0, 0, 0, 0, 0, 1.5]  # 0.5 x (1, 1, 3) at the ends 1, 2 and 9


SEEN: list[list[str]] = []


def echo_steps(prompt: str, steps: list[str], reference: str) -> list[float]:
    """Records the steps; scores 1.0 each but the last, which gets its number (3 of 3)."""
    SEEN.append(steps)
    return [float(i + 1) if i == len(steps) - 1 else 1.0 for i in range(len(steps))]


def test_multi_step_arithmetic_and_its_rule_rewards():
    assert [(p.prompt, p.answer) for p in problems("train", 2, 0, 30, terms=3)] == [("8+19+12=", "27,39"),
                                                                                    ("11+2+28=", "13,41")]
    train = {p.prompt for p in problems("train", 300, 0, 30, terms=3)}
    assert not train & {p.prompt for p in problems("eval", 300, 0, 30, terms=3)}  # splits never share a prompt
    assert all(len(p.answer.split(",")) == 3 for p in problems("eval", 5, 0, 9, terms=4))
    assert problems("train", 3, 0)[0].answer.isdigit()  # two terms: the plain task, one number
    assert final_reward("", "18,49", "19,49") == 1.0 and final_reward("", "19,48", "19,49") == 0.1
    assert final_reward("", "19,4", "19,49") == 0.0
    assert reward("", "19,49", "19,49") == 1.0 and reward("", "49", "19,49") == 0.0  # the plain reward is unchanged
    assert step_reward("", ["18", "49"], "19,49") == [0.0, 1.0]
    assert step_reward("", ["19", "49", "5"], "19,49") == [1.0, 1.0, 0.0]  # a step beyond the answer's


def two_answers(tokenizer) -> tuple[Rollout, list[torch.Tensor]]:
    """"19,49" and "19,4" to "3+16+30=", and their responses."""
    prompt = torch.tensor([tokenizer.bos_token_id, *tokenizer.encode("3+16+30=", add_special_tokens=False)])
    responses = [ids(tokenizer, "19,49"), ids(tokenizer, "19,4")]
    rollout = Rollout([torch.cat([prompt, r]) for r in responses], torch.tensor([len(prompt)] * 2, dtype=torch.int32),
                      [torch.zeros(len(r)) for r in responses], torch.tensor([7, 7]))
    return rollout, responses


def test_the_rule_in_reward_workers_gives_the_step_rewards_it_gives_here(tokenizer):
    rollout, _ = two_answers(tokenizer)
    cfg = ProcessRewardConfig(function=STEP_RULE, separator=",", weight=0.5)
    here = ProcessScorer(cfg, tokenizer).rewards(rollout, ["19,49", "19,49"])
    pool = RewardPool({STEPS: STEP_RULE}, workers=2, timeout_s=30, timeout_score=0.0)
    try:
        scorer = ProcessScorer(cfg, tokenizer, pool)
        there = scorer.rewards(rollout, ["19,49", "19,49"])
    finally:
        pool.close()
    assert [r.tolist() for r in here] == [[0, 0, 0.5, 0, 0, 0.5], [0, 0, 0.5, 0, 0]]
    assert [r.tolist() for r in there] == [r.tolist() for r in here] and scorer.timeouts == 0


def scored_experience(tokenizer, weight: float, values: list[list[float]]) -> Experience:
    """Two samples of one prompt, scored by the multi-step task's rules: "19,49" (both steps and the
    answer right) and "19,4" (first step right, answer wrong)."""
    rollout, responses = two_answers(tokenizer)
    cfg = ProcessRewardConfig(function=STEP_RULE, separator=",", weight=weight)
    process = ProcessScorer(cfg, tokenizer).rewards(rollout, ["19,49", "19,49"])
    scores = torch.tensor([final_reward("", tokenizer.decode(r, skip_special_tokens=True), "19,49") for r in responses])
    return Experience(
        sequences=rollout.sequences, prompt_lens=rollout.prompt_lens,
        mask=pad_right([torch.ones(len(r)) for r in responses], 0.0),
        behavior_logp=pad_right(rollout.behavior_logp, 0.0),
        old_logp=None, ref_logp=None, values=pad_right([torch.tensor(v) for v in values], 0.0), scores=scores,
        group_ids=rollout.group_ids, policy_versions=torch.zeros(2), process_rewards=pad_right(process, 0.0),
    )


def test_step_and_outcome_rewards_land_on_their_tokens_and_gae_matches_hand_computed_values(tokenizer):
    values = [[0.1, 0.2, 0.3, 0.4, 0.5, 0.6], [0.2] * 5]
    exp = scored_experience(tokenizer, 0.5, values)
    rewards = exp.token_rewards(0.0, KLConfig())
    # row 0: step "19" right at "," (0.5), step "49" right (0.5) + outcome 1.0 at <eos>
    # row 1: step "19" right at "," (0.5), step "4" wrong (0) + outcome 0 at <eos>; then padding
    assert torch.allclose(rewards, torch.tensor([[0, 0, 0.5, 0, 0, 1.5], [0, 0, 0.5, 0, 0, 0]]))
    advantages, returns = gae(rewards, exp.mask, exp.values, exp.group_ids, gamma=0.9, lam=0.5)
    # delta_t = r_t + 0.9 V_t+1 - V_t, A_t = delta_t + 0.45 A_t+1, worked out by hand:
    # row 0: deltas 0.08 0.07 0.56 0.05 0.04 0.9; row 1: -0.02 -0.02 0.48 -0.02 -0.2
    expected = torch.tensor([[0.24770403125, 0.372675625, 0.6726125, 0.25025, 0.445, 0.9],
                             [0.05817625, 0.173725, 0.4305, -0.11, -0.2, 0.0]])
    assert torch.allclose(advantages, expected, atol=1e-6)
    assert torch.allclose(returns, (expected + exp.values) * exp.mask, atol=1e-6)


def test_reinforce_pp_returns_and_grpo_rloo_sum_the_step_rewards(tokenizer):
    exp = scored_experience(tokenizer, 0.5, [[0.0] * 6, [0.0] * 5])
    rewards = exp.token_rewards(0.0, KLConfig())
    advantages, _ = reinforce_pp(rewards, exp.mask, None, exp.group_ids, gamma=1.0, lam=1.0)
    assert torch.allclose(advantages, torch.tensor([[2, 2, 2, 1.5, 1.5, 1.5], [0.5, 0.5, 0.5, 0, 0, 0]]))
    # GRPO / RLOO: one score per sample, outcome + weighted steps (2.0 and 0.5), normalised in the group
    advantages, _ = rloo(rewards, exp.mask, None, exp.group_ids, 1.0, 1.0)
    assert torch.allclose(advantages, torch.tensor([[1.5] * 6, [-1.5] * 5 + [0.0]]))
    advantages, _ = grpo(rewards, exp.mask, None, exp.group_ids, 1.0, 1.0)
    one = 1 / (1 + 1e-6 / 0.75)  # (2.0 - 1.25) / (0.75 + 1e-6)
    assert torch.allclose(advantages, torch.tensor([[one] * 6, [-one] * 5 + [0.0]]))
    outcome_only = scored_experience(tokenizer, 0.0, [[0.0] * 6, [0.0] * 5]).token_rewards(0.0, KLConfig())
    assert torch.allclose(outcome_only.sum(1), torch.tensor([1.0, 0.0]))  # weight 0: the outcome alone


def test_a_step_function_returning_the_wrong_number_of_scores_is_named(tokenizer):
    scorer = ProcessScorer(ProcessRewardConfig(function="tests.test_process_rewards:one_score"), tokenizer)
    rollout = Rollout([ids(tokenizer, "1+2+3=3,6")], torch.tensor([6], dtype=torch.int32), [torch.zeros(4)],
                      torch.tensor([0]))
    with pytest.raises(ValueError, match=r"one_score: returned 1 scores for the 2 steps \['3', '6'\]"):
        scorer.rewards(rollout, ["3,6"])


def one_score(prompt: str, steps: list[str], reference: str) -> list[float]:
    return [1.0]


@pytest.mark.parametrize(("separator", "message"), [
    ("ab", r"reward.process.separator='ab': the policy's tokenizer writes it as \['a', 'b'\]"),
    ("#", r"reward.process.separator='#': the policy's tokenizer writes it as \['<unk>'\]"),
])
def test_a_separator_that_is_not_one_token_fails_naming_the_key(tokenizer, separator, message):
    with pytest.raises(ConfigError, match=message):
        separator_id(tokenizer, separator)


def test_process_reward_config_checks(tmp_path):
    base = {"name": "p", "runs_dir": str(tmp_path)}
    with pytest.raises(ConfigError, match="reward.process.function=None, model_path=None: give one of them"):
        build(RLJobConfig, {**base, "reward": {"process": {"separator": ","}}})
    with pytest.raises(ConfigError, match="reward.process.model_path='/nowhere': no config.json"):
        build(RLJobConfig, {**base, "reward": {"process": {"model_path": "/nowhere"}}})
    with pytest.raises(ConfigError, match="reward.process.separator='': must be a non-empty"):
        build(RLJobConfig, {**base, "reward": {"process": {"function": STEP_RULE, "separator": ""}}})
    with pytest.raises(ConfigError, match="task.terms=1: must be >= 2"):
        build(RLJobConfig, {**base, "task": {"terms": 1}})
    cfg = build(RLJobConfig, {**base, "task": {"terms": 3}, "reward": {"process": {"function": STEP_RULE}}})
    assert cfg.reward.process.weight == 1.0 and cfg.task.terms == 3


def test_a_prm_scores_each_step_by_sigmoid_of_its_logit_at_the_steps_end(tmp_path, tokenizer):
    tiny = TinyModelConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                           num_key_value_heads=1, head_dim=32, max_position_embeddings=32)
    save_checkpoint(build_tiny(tiny, tokenizer, 0), tokenizer, tmp_path / "policy")
    result = train_tiny_prm(tmp_path / "prm", tmp_path / "policy", steps=2, batch_size=8)
    assert 0.0 <= result["step_accuracy"] <= 1.0
    assert json.loads((tmp_path / "prm" / "prm.json").read_text()) == result
    cfg = ProcessRewardConfig(model_path=str(tmp_path / "prm"), weight=2.0)
    check_process_reward(cfg, tokenizer)
    prompt = torch.tensor([tokenizer.bos_token_id, *tokenizer.encode("3+16+30=", add_special_tokens=False)])
    response = ids(tokenizer, "19,49")
    rollout = Rollout([torch.cat([prompt, response])], torch.tensor([len(prompt)], dtype=torch.int32),
                      [torch.zeros(len(response))], torch.tensor([0]))
    (rewards,) = ProcessScorer(cfg, tokenizer).rewards(rollout, ["19,49"])
    with torch.no_grad():
        logits = load_prm(tmp_path / "prm")(input_ids=rollout.sequences[0][None]).logits[0, :, 0]  # (L,)
    ends = torch.tensor([2, 5]) + len(prompt)
    assert torch.allclose(rewards[[2, 5]], 2.0 * torch.sigmoid(logits[ends]), atol=1e-5)
    assert rewards[[0, 1, 3, 4]].abs().sum() == 0
    build_tokenizer(vision=True).save_pretrained(tmp_path / "prm")  # a PRM of another vocabulary
    with pytest.raises(ConfigError, match="reward.process.model_path=.*prm.*: its tokenizer differs from the policy's"):
        check_process_reward(cfg, tokenizer)


def test_the_prm_training_data_labels_each_step_by_whether_it_is_the_partial_sum():
    rng = random.Random(0)
    wrong = 0
    for problem in problems("train", 200, 0, 30, terms=3):
        steps, labels = corrupted_steps(problem.answer, rng)
        assert labels == step_reward(problem.prompt, steps, problem.answer)
        wrong += labels.count(0.0)
    assert 120 < wrong < 280  # about half of the 400 steps are made wrong


def test_the_driver_checks_the_separator_against_the_policys_tokenizer_before_the_warm_start(tmp_path):
    data = {"name": "p", "runs_dir": str(tmp_path), "iterations": 1,
            "reward": {"process": {"function": STEP_RULE, "separator": "=>"}}}
    with pytest.raises(ConfigError, match=r"reward.process.separator='=>': the policy's tokenizer writes it as "):
        check_prompts(build(RLJobConfig, data))
    data["reward"]["process"]["separator"] = "="
    check_prompts(build(RLJobConfig, data))
