"""`placement.with_rollout` in the planner (`planner/search.py`): train-side stages on rollout's
cores in the simulated placement and as a search axis, on small graphs worked out by hand in each
test's docstring (times in seconds)."""

from __future__ import annotations

import pytest

from stream_rlhf.planner.calibrate import Profile
from stream_rlhf.planner.search import devices_of, fits, predict, search, with_rollout_candidates

PPO_STAGES = {"prompts", "rollout", "ref_forward", "reward_forward", "actor_forward", "critic_forward",
              "actor_train", "critic_train"}


def two_trainers(critic_s: float = 1.0) -> Profile:
    """prompts (free) -> rollout (1 s) -> actor_train (2 s) and critic_train, one mini-batch an
    iteration, no contention, no lending fitted."""
    return Profile(step_s={"prompts": (0.0,), "rollout": (1.0,), "critic_train": (critic_s,), "actor_train": (2.0,)},
                   minibatches=1, inputs={"prompts": (), "rollout": ("prompts",), "critic_train": ("rollout",),
                                          "actor_train": ("rollout",)},
                   rollout_side=frozenset({"prompts", "rollout"}), publish_s=0.0, weights_load_s=0.0)


def test_a_stage_moved_to_rollouts_idle_cores_leaves_the_train_side_its_own_work():
    """Separated, stream k=1. Both trainers on the train cores: 2 + 1 = 3 s of train work an
    iteration, rollout (1 s) idles beside it: 3 s per iteration. critic_train on rollout's cores:
    rollout + critic_train = 2 s there, actor_train 2 s on the train cores: 2 s, critic_train's
    1 s saved."""
    profile = two_trainers()
    assert devices_of(profile, "separated", ["critic_train"]) == {
        "prompts": "rollout cores", "rollout": "rollout cores", "critic_train": "rollout cores",
        "actor_train": "train cores"}
    assert devices_of(profile, "colocated", ["critic_train"]) == dict.fromkeys(profile.step_s, "all cores")
    shipped = predict(profile, iterations=8, schedule="stream", overlap_depth=1, mode="separated")
    moved = predict(profile, iterations=8, schedule="stream", overlap_depth=1, mode="separated",
                    with_rollout=["critic_train"])
    assert shipped.iteration_s == pytest.approx(3.0)
    assert moved.iteration_s == pytest.approx(2.0)
    assert moved.figures is not None and moved.figures.busy["actor_train"] == pytest.approx(1.0)


def test_a_moved_stage_keeps_the_train_sides_sync_barrier():
    """Sync: critic_train still waits for rollout's whole iteration (the phase barrier is the
    dataflow's, not the cores'). Both trainers on the train cores: rollout 1, critic_train 1 (the
    graph's order), actor_train 2, then the next rollout: 4 s per iteration. critic_train on
    rollout's cores runs after rollout beside actor_train: 1 + 2 = 3 s."""
    profile = two_trainers()
    graph = profile.graph(iterations=4, overlap_depth=0, schedule="sync",
                          devices=devices_of(profile, "separated", ["critic_train"]))
    assert graph.stage("critic_train").barrier and graph.stage("critic_train").side == "train"
    together = predict(profile, iterations=8, schedule="sync", overlap_depth=0, mode="separated")
    moved = predict(profile, iterations=8, schedule="sync", overlap_depth=0, mode="separated",
                    with_rollout=["critic_train"])
    assert together.iteration_s == pytest.approx(4.0)
    assert moved.iteration_s == pytest.approx(3.0)


def test_the_search_moves_the_critic_when_it_pays_and_lists_its_set_line():
    """with_rollout candidates of these stages: none and critic_train (the critic's stages and the
    forwards add nothing new); the trainers' device group cannot be split between the sides. So
    ({} x 2 + trainers x 1) separated + 2 colocated = 5 placements x 4 schedules = 20 plans; the
    best is stream k=1 with critic_train on rollout's cores (2 s, above)."""
    plans = search(two_trainers(), iterations=8)
    assert len(plans) == 20
    assert plans[0].sets == ["schedule=stream", "overlap_depth=1", "placement.mode=separated",
                             "placement.device_groups={}", "placement.with_rollout=[critic_train]"]
    assert plans[0].prediction.iteration_s == pytest.approx(2.0)
    assert not any(plan.groups and plan.with_rollout for plan in plans)
    assert all(plan.sets[4] == "placement.with_rollout=[]" for plan in plans if plan.mode == "colocated")


def test_moving_nothing_wins_a_tie():
    """A free critic_train (0 s) costs the train side nothing: both placements predict 2 s, and
    the plan that moves nothing comes first."""
    plans = search(two_trainers(critic_s=0.0), iterations=8, groups=[{}], modes=("separated",))
    assert [p.with_rollout for p in plans[:2]] == [(), ("critic_train",)]
    assert plans[0].prediction.iteration_s == pytest.approx(plans[1].prediction.iteration_s) == pytest.approx(2.0)


def test_the_candidates_are_the_critic_and_the_forwards_each_once():
    """PPO: none, critic_train, the critic's stages, the four forwards, and those with critic_train
    (STAGE_KINDS order); GRPO (no critic): none and the forwards."""
    assert with_rollout_candidates(PPO_STAGES) == [
        (), ("critic_train",), ("critic_forward", "critic_train"),
        ("ref_forward", "reward_forward", "actor_forward", "critic_forward"),
        ("ref_forward", "reward_forward", "actor_forward", "critic_forward", "critic_train")]
    grpo = {"prompts", "rollout", "ref_forward", "reward_forward", "actor_train"}
    assert with_rollout_candidates(grpo) == [(), ("ref_forward", "reward_forward")]


@pytest.mark.parametrize("groups, moved, ok", [
    ({}, ("critic_train",), True),
    ({"forwards": ["ref_forward", "critic_forward"]}, ("critic_forward", "critic_train"), False),
    ({"forwards": ["ref_forward", "critic_forward"]}, ("ref_forward", "critic_forward"), True),
    ({"trainers": ["actor_train", "critic_train"]}, ("critic_train",), False),
])
def test_a_device_group_goes_to_one_side_whole(groups, moved, ok):
    assert fits(groups, moved) is ok
