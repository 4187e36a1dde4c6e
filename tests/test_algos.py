"""RL algorithm math (`stream_rlhf.algos`) against numbers worked out by hand on tiny tensors.

Every expected value is written out as a number, with the arithmetic in a comment, rather than
recomputed by the formula under test. Run: `python -m pytest tests/test_algos.py -q`.
"""

from __future__ import annotations

import math

import pytest
import torch

from stream_rlhf.algos.advantages import ADVANTAGE_ESTIMATORS, NEEDS_CRITIC, gae, grpo, reinforce_pp, rloo
from stream_rlhf.algos.aggregation import row_weights
from stream_rlhf.algos.kl import AdaptiveKLController, FixedKLController, kl_estimate
from stream_rlhf.algos.losses import entropy_loss, host_metrics, kl_loss, policy_loss, value_loss
from stream_rlhf.algos.masked import masked_mean, masked_whiten


def close(actual: torch.Tensor | float, expected: list | float, atol: float = 1e-5) -> None:
    torch.testing.assert_close(torch.as_tensor(actual, dtype=torch.float32), torch.tensor(expected), atol=atol, rtol=0)


# ---------------------------------------------------------------- masked statistics


def test_masked_mean_ignores_masked_out_values_even_nan():
    x = torch.tensor([[1.0, 2.0, float("nan")], [4.0, 5.0, float("inf")]])
    mask = torch.tensor([[1, 1, 0], [0, 1, 0]], dtype=torch.float32)
    close(masked_mean(x, mask), 8 / 3)  # (1 + 2 + 5) / 3
    close(masked_mean(x, mask, dim=1), [1.5, 5.0])  # (1 + 2) / 2, 5 / 1
    close(masked_mean(x, mask.bool(), dim=1), [1.5, 5.0])  # a bool mask works the same


def test_masked_mean_of_empty_mask_is_zero_not_nan():
    x = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    mask = torch.tensor([[0, 0], [1, 0]])
    close(masked_mean(x, torch.zeros_like(x)), 0.0)
    close(masked_mean(x, mask, dim=1), [0.0, 3.0])  # row 0 has no valid element
    close(masked_whiten(x, torch.zeros_like(x)), [[0.0, 0.0], [0.0, 0.0]])


def test_masked_whiten_by_hand():
    x = torch.tensor([[1.0, 2.0, 3.0, 100.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    # mean 2, population variance (1 + 0 + 1) / 3 = 2/3, std 0.8164966; (x - 2) / std = -+1.2247449
    close(masked_whiten(x, mask), [[-1.2247449, 0.0, 1.2247449, 0.0]])
    # shift_mean=False keeps the mean: 2 -+ 1.2247449
    close(masked_whiten(x, mask, shift_mean=False), [[0.7752551, 2.0, 3.2247449, 0.0]])


def test_masked_whiten_gives_mean_zero_std_one_over_masked_elements():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(3, 7, generator=generator) * 5 + 3
    mask = torch.rand(3, 7, generator=generator) > 0.4
    mask[0, 0] = mask[0, 1] = True
    out = masked_whiten(x, mask)
    close(out[mask].mean(), 0.0)
    close(out[mask].std(unbiased=False), 1.0)
    assert (out[~mask] == 0).all()


# ---------------------------------------------------------------- advantage estimators


def test_gae_by_hand_with_prompt_padding_and_a_gap():
    # gamma = lam = 0.5, so gamma * lam = 0.25. Masked-out positions hold junk that must be ignored.
    rewards = torch.tensor(
        [
            [1.0, 0.0, 2.0, 3.0, 3.0],  # row 0: 3 valid tokens, then padding
            [7.0, 0.0, 0.0, 1.0, 5.0],  # row 1: prompt token, 3 response tokens, padding
            [0.0, 5.0, 2.0, 0.0, 0.0],  # row 2: a masked gap between two valid tokens
        ]
    )
    values = torch.tensor(
        [
            [0.5, 1.0, 1.5, 9.0, 9.0],
            [9.0, 0.5, 0.5, 0.5, 9.0],
            [0.5, 9.0, 1.0, 9.0, 9.0],
        ]
    )
    mask = torch.tensor([[1, 1, 1, 0, 0], [0, 1, 1, 1, 0], [1, 0, 1, 0, 0]])
    advantages, returns = gae(rewards, mask, values, torch.arange(3), gamma=0.5, lam=0.5)
    # row 0: t2: delta = 2 + 0 - 1.5 = 0.5,          A = 0.5
    #        t1: delta = 0 + 0.5*1.5 - 1.0 = -0.25,  A = -0.25 + 0.25*0.5 = -0.125
    #        t0: delta = 1 + 0.5*1.0 - 0.5 = 1.0,    A = 1.0 + 0.25*(-0.125) = 0.96875
    # row 1: t3: delta = 1 + 0 - 0.5 = 0.5,          A = 0.5
    #        t2: delta = 0 + 0.5*0.5 - 0.5 = -0.25,  A = -0.25 + 0.25*0.5 = -0.125
    #        t1: delta = -0.25,                      A = -0.25 + 0.25*(-0.125) = -0.28125
    # row 2: t2: delta = 2 + 0 - 1 = 1,              A = 1
    #        t0: next valid is t2: delta = 0 + 0.5*1 - 0.5 = 0, A = 0 + 0.25*1 = 0.25
    close(
        advantages,
        [
            [0.96875, -0.125, 0.5, 0.0, 0.0],
            [0.0, -0.28125, -0.125, 0.5, 0.0],
            [0.25, 0.0, 1.0, 0.0, 0.0],
        ],
    )
    # returns = A + V on valid tokens
    close(
        returns,
        [
            [1.46875, 0.875, 2.0, 0.0, 0.0],
            [0.0, 0.21875, 0.375, 1.0, 0.0],
            [0.75, 0.0, 2.0, 0.0, 0.0],
        ],
    )


def test_gae_without_values_fails():
    with pytest.raises(ValueError, match="values"):
        gae(torch.zeros(1, 2), torch.ones(1, 2), None, torch.zeros(1, dtype=torch.long), 1.0, 1.0)


# Six rows in three groups, ids interleaved and not 0..G-1. Scores (sum of valid rewards):
#   row 0 group 5: 1        row 1 group 2: 0        row 2 group 5: 3 (the masked 4 does not count)
#   row 3 group 2: 0        row 4 group 2: 3        row 5 group 9: 7 (alone in its group)
GROUP_REWARDS = torch.tensor(
    [[0.0, 0.0, 1.0], [0.0, 0.0, 0.0], [0.0, 3.0, 4.0], [9.0, 0.0, 0.0], [0.0, 3.0, 0.0], [0.0, 0.0, 7.0]]
)
GROUP_MASK = torch.tensor([[1, 1, 1], [1, 1, 1], [1, 1, 0], [0, 1, 1], [1, 1, 0], [1, 1, 1]])
GROUP_IDS = torch.tensor([5, 2, 5, 2, 2, 9])


def expand(row_values: list[float]) -> list[list[float]]:
    """Row advantages onto GROUP_MASK's valid tokens."""
    return [[v * m for m in row] for v, row in zip(row_values, GROUP_MASK.tolist())]


def test_grpo_normalises_within_each_group():
    advantages, returns = grpo(GROUP_REWARDS, GROUP_MASK, None, GROUP_IDS, gamma=1.0, lam=1.0)
    # group 5: {1, 3}: mean 2, population std 1 -> -1, +1 (divided by 1 + 1e-6)
    # group 2: {0, 0, 3}: mean 1, population var (1 + 1 + 4) / 3 = 2, std 1.4142136
    #          -> -1/1.4142136 = -0.7071068 twice, 2/1.4142136 = 1.4142136
    # group 9: a single member -> 0
    expected = expand([-1.0, -0.7071068, 1.0, -0.7071068, 1.4142136, 0.0])
    close(advantages, expected)
    close(returns, expected)


def test_grpo_without_the_group_std_only_centres_dr_grpo():
    advantages, returns = grpo(GROUP_REWARDS, GROUP_MASK, None, GROUP_IDS, 1.0, 1.0, scale=False)
    # group 5: {1, 3} - 2 -> -1, +1; group 2: {0, 0, 3} - 1 -> -1, -1, 2; group 9 -> 0
    expected = expand([-1.0, -1.0, 1.0, -1.0, 2.0, 0.0])
    close(advantages, expected)
    close(returns, expected)


def test_grpo_group_with_equal_scores_gets_zero():
    advantages, _ = grpo(torch.tensor([[2.0], [2.0]]), torch.ones(2, 1), None, torch.tensor([0, 0]), 1.0, 1.0)
    close(advantages, [[0.0], [0.0]])


def test_rloo_subtracts_the_mean_of_the_others():
    advantages, returns = rloo(GROUP_REWARDS, GROUP_MASK, None, GROUP_IDS, gamma=1.0, lam=1.0)
    # group 5: 1 - 3 = -2, 3 - 1 = 2
    # group 2: 0 - (0 + 3)/2 = -1.5, 0 - (0 + 3)/2 = -1.5, 3 - (0 + 0)/2 = 3
    # group 9: a single member -> 0
    expected = expand([-2.0, -1.5, 2.0, -1.5, 3.0, 0.0])
    close(advantages, expected)
    close(returns, expected)


@pytest.mark.parametrize("estimator", [grpo, rloo])
def test_a_row_without_valid_tokens_is_no_member_of_its_group(estimator):
    """Row 3 of group 2 masked out entirely (a failed episode under env.failed_episodes=mask): the
    group is {0, 3} (rows 1 and 4), as if row 3 were not there, and row 3's advantages are 0."""
    mask = GROUP_MASK.clone()
    mask[3] = 0
    advantages, _ = estimator(GROUP_REWARDS, mask, None, GROUP_IDS, gamma=1.0, lam=1.0)
    keep = torch.tensor([0, 1, 2, 4, 5])
    without, _ = estimator(GROUP_REWARDS[keep], GROUP_MASK[keep], None, GROUP_IDS[keep], gamma=1.0, lam=1.0)
    close(advantages[keep], without.tolist())
    assert advantages[3].abs().sum() == 0
    alone, _ = estimator(torch.ones(2, 2), torch.zeros(2, 2), None, torch.tensor([0, 0]), 1.0, 1.0)
    close(alone, [[0.0, 0.0], [0.0, 0.0]])  # a group with no member: zeros, not NaN


def test_reinforce_pp_discounted_return_to_go_over_valid_tokens():
    rewards = torch.tensor([[1.0, 0.0, 2.0, 5.0], [9.0, 0.0, 4.0, 9.0]])
    mask = torch.tensor([[1, 1, 1, 0], [0, 1, 1, 0]])
    advantages, returns = reinforce_pp(rewards, mask, None, torch.arange(2), gamma=0.5, lam=0.0)
    # row 0: G2 = 2, G1 = 0 + 0.5*2 = 1, G0 = 1 + 0.5*1 = 1.5 (the padded 5 is ignored)
    # row 1: G2 = 4, G1 = 0 + 0.5*4 = 2 (the prompt's and padding's 9 are ignored)
    expected = [[1.5, 1.0, 2.0, 0.0], [0.0, 2.0, 4.0, 0.0]]
    close(returns, expected)
    close(advantages, expected)


def test_estimator_table_shares_one_signature():
    rewards, mask = torch.ones(4, 3), torch.ones(4, 3)
    values, group_ids = torch.ones(4, 3), torch.tensor([0, 0, 1, 1])
    assert set(ADVANTAGE_ESTIMATORS) == {"gae", "grpo", "rloo", "reinforce_pp"}
    assert NEEDS_CRITIC == {"gae"}
    for name, estimator in ADVANTAGE_ESTIMATORS.items():
        advantages, returns = estimator(rewards, mask, values if name in NEEDS_CRITIC else None, group_ids, 0.9, 0.95)
        assert advantages.shape == returns.shape == (4, 3), name


# ---------------------------------------------------------------- KL


def test_kl_estimators_by_hand():
    logp = torch.tensor([-1.0, -2.0, -0.5])
    ref_logp = torch.tensor([-2.0, -1.0, -0.5])
    # logp - ref = [1, -1, 0]
    close(kl_estimate(logp, ref_logp, "k1"), [1.0, -1.0, 0.0])
    close(kl_estimate(logp, ref_logp, "k2"), [0.5, 0.5, 0.0])
    # d = ref - logp = [-1, 1, 0]: e^-1 + 1 - 1 = 0.3678794; e - 1 - 1 = 0.7182818; 1 - 0 - 1 = 0
    close(kl_estimate(logp, ref_logp, "k3"), [0.3678794, 0.7182818, 0.0])


def test_k3_clamps_the_log_ratio():
    # d = -100 clamped to -20: e^-20 + 20 - 1 = 19.000000002
    close(kl_estimate(torch.tensor([0.0]), torch.tensor([-100.0]), "k3"), [19.0])
    assert torch.isfinite(kl_estimate(torch.tensor([-1000.0]), torch.tensor([0.0]), "k3")).all()
    with pytest.raises(ValueError, match="k4"):
        kl_estimate(torch.zeros(1), torch.zeros(1), "k4")  # type: ignore[arg-type]


def test_adaptive_kl_controller_by_hand():
    controller = AdaptiveKLController(init_coef=0.1, target=6.0, horizon=10_000)
    controller.update(current_kl=9.0, n_steps=256)
    # 9/6 - 1 = 0.5, clipped to 0.2: 0.1 * (1 + 0.2 * 256 / 10000) = 0.1 * 1.00512 = 0.100512
    assert controller.coef == pytest.approx(0.100512)
    controller.update(current_kl=5.4, n_steps=1000)
    # 5.4/6 - 1 = -0.1 (inside the clip): 0.100512 * (1 - 0.1 * 1000 / 10000) = 0.100512 * 0.99 = 0.09950688
    assert controller.coef == pytest.approx(0.09950688)


def test_fixed_kl_controller_does_not_move():
    controller = FixedKLController(coef=0.05)
    controller.update(current_kl=100.0, n_steps=1000)
    assert controller.coef == 0.05


def test_kl_loss_is_the_masked_mean_of_the_estimate():
    logp = torch.tensor([[-1.0, -2.0, 0.0]], requires_grad=True)
    ref_logp = torch.tensor([[-2.0, -1.0, -5.0]])
    loss, metrics = kl_loss(logp, ref_logp, torch.tensor([[1, 1, 0]]), "k3")
    metrics = host_metrics(metrics)
    # (0.3678794 + 0.7182818) / 2 = 0.5430806; the masked third token (k3 = e^-5 + 4) does not count
    close(loss, 0.5430806)
    assert metrics == {"kl": pytest.approx(0.5430806)}
    loss.backward()
    assert logp.grad is not None


# ---------------------------------------------------------------- policy loss

# clip_low 0.2, clip_high 0.28: the ratio is kept in [0.8, 1.28]. Five tokens, the last masked out:
#   t0 ratio 1.1, A =  2: inside the range             -> -min(2.2, 2.2)             = -2.2
#   t1 ratio 1.5, A =  1: above, positive advantage    -> -min(1.5, 1.28)            = -1.28  clipped
#   t2 ratio 0.5, A = -1: below, negative advantage    -> -min(-0.5, -0.8)           =  0.8   clipped
#   t3 ratio 1.5, A = -1: above, negative advantage    -> -min(-1.5, -1.28)          =  1.5   not clipped
#   t4 ratio 10,  A =  5: masked out
RATIOS = [1.1, 1.5, 0.5, 1.5, 10.0]
POLICY_ADVANTAGES = torch.tensor([[2.0, 1.0, -1.0, -1.0, 5.0]])
POLICY_MASK = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0]])


def policy_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    old_logp = torch.full((1, 5), -1.0, requires_grad=True)
    logp = (old_logp.detach() + torch.log(torch.tensor([RATIOS]))).requires_grad_()
    return logp, old_logp


def test_policy_loss_clipping_by_hand():
    logp, old_logp = policy_inputs()
    loss, metrics = policy_loss(logp, old_logp, POLICY_ADVANTAGES, POLICY_MASK, clip_low=0.2, clip_high=0.28)
    metrics = host_metrics(metrics)
    close(loss, -0.295)  # (-2.2 - 1.28 + 0.8 + 1.5) / 4 = -1.18 / 4
    assert metrics["clipfrac"] == pytest.approx(0.5)  # t1, t2 of 4
    assert metrics["ratio_max"] == pytest.approx(1.5)  # t4's 10 is masked out
    # approx_kl, k3 of KL(old || new): ratio - 1 - ln ratio per token
    #   t0 0.1 - 0.0953102 = 0.0046898, t1 and t3 0.5 - 0.4054651 = 0.0945349, t2 -0.5 + 0.6931472 = 0.1931472
    #   (0.0046898 + 2 * 0.0945349 + 0.1931472) / 4 = 0.0967267
    assert metrics["approx_kl"] == pytest.approx(0.0967267, abs=1e-6)
    assert set(metrics) == {"clipfrac", "approx_kl", "ratio_max"}
    assert all(type(v) is float for v in metrics.values())


def test_policy_loss_gradient_reaches_logp_only():
    logp, old_logp = policy_inputs()
    behavior_logp = old_logp.detach().clone().requires_grad_()
    loss, _ = policy_loss(
        logp, old_logp, POLICY_ADVANTAGES, POLICY_MASK, 0.2, 0.28, behavior_logp=behavior_logp, is_cap=None
    )
    loss.backward()
    # d loss / d logp = -A * ratio / 4 on unclipped valid tokens, 0 on clipped and masked ones:
    #   t0 -2 * 1.1 / 4 = -0.55, t3 1 * 1.5 / 4 = 0.375 (the behavior weight is 1 here)
    close(logp.grad, [[-0.55, 0.0, 0.0, 0.375, 0.0]])
    assert old_logp.grad is None
    assert behavior_logp.grad is None


def test_policy_loss_with_sequence_ratios_gspo_by_hand():
    # log-ratios (old_logp 0): row 0 [0.2, 0.0] (its third position padding: 7 is never read), mean
    # 0.1, ratio e^0.1 = 1.1051709; row 1 [0.6, 0.2, 0.4], mean 0.4, ratio e^0.4 = 1.4918247 > 1.2:
    # clipped as a whole
    logp = torch.tensor([[0.2, 0.0, 7.0], [0.6, 0.2, 0.4]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    loss, metrics = policy_loss(logp, torch.zeros(2, 3), torch.ones(2, 3), mask, 0.2, 0.2, sequence_ratio=True)
    close(loss, -1.1620684)  # -(2 * 1.1051709 + 3 * 1.2) / 5
    loss.backward()
    # row 0's tokens share d(-2 e^m / 5)/d logp_t = -(2 / 5)(e^m / 2) = -1.1051709 / 5; row 1: clipped, 0
    close(logp.grad, [[-0.2210342, -0.2210342, 0.0], [0.0, 0.0, 0.0]])
    metrics = host_metrics(metrics)
    assert metrics["clipfrac"] == pytest.approx(0.6)  # row 1's 3 tokens of 5
    assert metrics["ratio_max"] == pytest.approx(1.4918247)
    # (2 (1.1051709 - 1 - 0.1) + 3 (1.4918247 - 1 - 0.4)) / 5
    assert metrics["approx_kl"] == pytest.approx(0.0571632, abs=1e-6)


def test_policy_loss_truncated_importance_weights():
    logp, old_logp = policy_inputs()
    # w = exp(old_logp - behavior_logp) = [0.5, 2, 4, 1, 100]
    behavior_logp = old_logp.detach() - torch.log(torch.tensor([[0.5, 2.0, 4.0, 1.0, 100.0]]))
    loss, metrics = policy_loss(
        logp, old_logp, POLICY_ADVANTAGES, POLICY_MASK, 0.2, 0.28, behavior_logp=behavior_logp, is_cap=3.0
    )
    metrics = host_metrics(metrics)
    # capped at 3: w = [0.5, 2, 3, 1]; (-2.2*0.5 - 1.28*2 + 0.8*3 + 1.5*1) / 4 = (-1.1 - 2.56 + 2.4 + 1.5) / 4 = 0.06
    close(loss, 0.06)
    assert metrics["is_weight_mean"] == pytest.approx(1.625)  # (0.5 + 2 + 3 + 1) / 4
    assert metrics["is_truncated_frac"] == pytest.approx(0.25)  # only t2 of 4; masked t4 does not count
    loss.backward()
    close(logp.grad, [[-0.275, 0.0, 0.0, 0.375, 0.0]])  # -0.55 * 0.5, 0.375 * 1

    loss, metrics = policy_loss(
        logp, old_logp, POLICY_ADVANTAGES, POLICY_MASK, 0.2, 0.28, behavior_logp=behavior_logp, is_cap=None
    )
    metrics = host_metrics(metrics)
    # uncapped: (-1.1 - 2.56 + 0.8*4 + 1.5) / 4 = 1.04 / 4 = 0.26
    close(loss, 0.26)
    assert metrics["is_weight_mean"] == pytest.approx(1.875)  # (0.5 + 2 + 4 + 1) / 4
    assert metrics["is_truncated_frac"] == 0.0


def test_losses_with_empty_mask_are_zero_not_nan():
    logp, old_logp = policy_inputs()
    empty = torch.zeros(1, 5)
    loss, metrics = policy_loss(logp, old_logp, POLICY_ADVANTAGES, empty, 0.2, 0.28, behavior_logp=old_logp, is_cap=2)
    metrics = host_metrics(metrics)
    assert loss.item() == 0.0
    assert all(math.isfinite(v) for v in metrics.values())
    loss, metrics = value_loss(torch.ones(1, 5), torch.zeros(1, 5), torch.zeros(1, 5), empty, 0.2)
    metrics = host_metrics(metrics)
    assert loss.item() == 0.0 and all(math.isfinite(v) for v in metrics.values())


# ---------------------------------------------------------------- value and entropy losses


def test_value_loss_clipping_by_hand():
    # eps 0.2. t0: v 1.0, old 0.9, R 1.5: inside, (1 - 1.5)^2 = 0.25 both ways
    #          t1: v 2.0, old 1.0, R 1.0: clipped v 1.2; max(1.0, 0.04) = 1.0, unclipped term wins
    #          t2: v 2.0, old 1.0, R 3.0: clipped v 1.2; max(1.0, 3.24) = 3.24, clipped term wins
    #          t3: masked out
    values = torch.tensor([[1.0, 2.0, 2.0, 50.0]], requires_grad=True)
    old_values = torch.tensor([[0.9, 1.0, 1.0, 0.0]])
    returns = torch.tensor([[1.5, 1.0, 3.0, 0.0]])
    loss, metrics = value_loss(values, old_values, returns, torch.tensor([[1, 1, 1, 0]]), clip_eps=0.2)
    metrics = host_metrics(metrics)
    close(loss, 0.7483333)  # 0.5 * (0.25 + 1.0 + 3.24) / 3 = 0.5 * 4.49 / 3
    assert metrics["value_clipfrac"] == pytest.approx(1 / 3)  # t2
    assert metrics["value_mse"] == pytest.approx(0.75)  # (0.25 + 1 + 1) / 3
    loss.backward()
    # d/dv 0.5 * (v - R)^2 / 3 = (v - R) / 3 where unclipped wins; 0 through the clipped t2
    close(values.grad, [[-0.5 / 3, 1 / 3, 0.0, 0.0]])


def test_entropy_loss_is_a_bonus():
    loss, metrics = entropy_loss(torch.tensor([[1.0, 2.0, 9.0]]), torch.tensor([[1, 1, 0]]))
    metrics = host_metrics(metrics)
    close(loss, -1.5)  # -(1 + 2) / 2
    assert metrics == {"entropy": pytest.approx(1.5)}


# ---------------------------------------------------------------- loss aggregation

# an optimizer step of 3 samples with 1, 3 and 0 policy tokens (the last: an episode masked out)
AGG_MASK = torch.tensor([[1, 0, 0], [1, 1, 1], [0, 0, 0]], dtype=torch.float32)
AGG_VALUES = torch.tensor([[6.0, 9.0, 9.0], [1.0, 2.0, 3.0], [7.0, 7.0, 7.0]])


def test_row_weights_make_the_token_mean_a_sequence_mean_or_a_budgeted_sum():
    assert row_weights(AGG_MASK, "token_mean", 8) is None
    # 4 tokens, 2 samples with any: sequence_mean w_i = 4 / (2 n_i) -> 2, 2/3; the empty row's is
    # never used (it has no token)
    sequence = row_weights(AGG_MASK, "sequence_mean", 8)
    close(sequence[:2], [2.0, 0.6666667])
    # weighted token mean: (6 * 2 + (1 + 2 + 3) * 2/3) / 4 = 16 / 4 = 4 = mean(6, mean(1, 2, 3) = 2)
    close(masked_mean(AGG_VALUES * sequence[:, None], AGG_MASK), 4.0)
    # token_sum, budget 8: w = 4 / (2 * 8) = 0.25 each; (6 + 6) * 0.25 / 4 = 0.75 = mean(6 / 8, 6 / 8)
    budget = row_weights(AGG_MASK, "token_sum", 8)
    close(budget, [0.25, 0.25, 0.25])
    close(masked_mean(AGG_VALUES * budget[:, None], AGG_MASK), 0.75)
    assert row_weights(torch.zeros(2, 3), "sequence_mean", 8).tolist() == [0.0, 0.0]  # no token: no NaN


def test_the_actors_losses_take_the_row_weights_and_report_plain_means():
    weights = row_weights(AGG_MASK, "sequence_mean", 8)
    logp = (-AGG_VALUES / 10).requires_grad_()
    loss, metrics = policy_loss(logp, logp.detach(), torch.ones(3, 3), AGG_MASK, 0.2, 0.2, row_weights=weights)
    # ratio 1, A 1: -1 per token; the sequence mean of -1 is -1, and each sample's tokens share a
    # gradient of -1 / (samples n_i): t0 -1/2, sample 1's -1/6 each
    close(loss, -1.0)
    loss.backward()
    close(logp.grad, [[-0.5, 0.0, 0.0], [-0.1666667, -0.1666667, -0.1666667], [0.0, 0.0, 0.0]])
    assert host_metrics(metrics)["clipfrac"] == 0.0
    entropy_term, entropy_metrics = entropy_loss(AGG_VALUES, AGG_MASK, weights)
    close(entropy_term, -4.0)  # the sequence mean of the entropy, (6 + 2) / 2
    close(entropy_metrics["entropy"], 3.0)  # the token mean, (6 + 1 + 2 + 3) / 4, as without weights
    kl_term, kl_metrics = kl_loss(torch.zeros(3, 3), -AGG_VALUES, AGG_MASK, "k1", weights)
    close(kl_term, 4.0)  # k1 = logp - ref_logp = the values: their sequence mean
    close(kl_metrics["kl"], 3.0)
