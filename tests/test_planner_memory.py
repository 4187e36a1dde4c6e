"""Memory in the planner (`planner/memory.py`): a run's processes as a runtime plus each stage's own
part, the host and device memory of plans with and without device groups (worked out by hand in
each docstring, MB), the device-group candidates of the search and the memory limit."""

from __future__ import annotations

import pytest

from stream_rlhf.config import load_config
from stream_rlhf.driver.plan import preview_plan
from stream_rlhf.planner.calibrate import Profile
from stream_rlhf.planner.graph import SimGraph, SimStage
from stream_rlhf.planner.job_prediction import buildable_groups
from stream_rlhf.planner.memory import memory_profile, stage_of_process
from stream_rlhf.planner.search import device_group_candidates, predict, search, within_memory
from stream_rlhf.planner.simulator import simulate
from stream_rlhf.rl.config import RLJobConfig
from tests.rl_tiny import tiny_job, write_job

PSS = {"broker": 170.0, "prompts-0": 320.0, "rollout-0": 300.0, "ref_forward-0": 290.0,
       "critic_forward-0": 310.0, "actor_train-0": 450.0, "critic_train-0": 440.0}
FORWARDS = {"forwards": ["ref_forward", "critic_forward"]}
BOTH = {**FORWARDS, "trainers": ["actor_train", "critic_train"]}


def summary(pss: dict[str, float], **blocks: object) -> dict[str, object]:
    per_process = {name: {"peak_pss_mb": mb, "peak_uss_mb": mb, "peak_rss_mb": mb} for name, mb in pss.items()}
    return {"memory": {"peak_pss_mb": sum(pss.values()), "per_process": per_process}, **blocks}


def profile(**blocks: object) -> Profile:
    """prompts -> rollout -> ref, critic forward -> both trainers, one mini-batch per iteration."""
    inputs = {"prompts": (), "rollout": ("prompts",), "ref_forward": ("rollout",), "critic_forward": ("rollout",),
              "actor_train": ("rollout", "ref_forward", "critic_forward"),
              "critic_train": ("rollout", "critic_forward")}
    costs = {"prompts": 0.0, "rollout": 1.0, "ref_forward": 0.25, "critic_forward": 0.25, "actor_train": 0.5,
             "critic_train": 0.25}
    return Profile(step_s={stage: (cost,) for stage, cost in costs.items()}, minibatches=1, inputs=inputs,
                   rollout_side=frozenset({"prompts", "rollout"}), publish_s=0.0, weights_load_s=0.0,
                   memory=memory_profile(summary(PSS, **blocks)))


def test_a_process_is_a_runtime_plus_its_stage():
    """The runtime is the smallest stage process (ref_forward, 290; the broker runs no stage and
    is kept as measured); a stage of two ranks has two runtimes in its figure."""
    memory = memory_profile(summary({**PSS, "actor_train-0.rank1": 430.0, "rollout-1": 305.0}))
    assert memory.runtime_mb == 290.0 and memory.other_mb == 170.0
    assert memory.own_mb["actor_train"] == (450 - 290) + (430 - 290)
    assert memory.processes == {"prompts": 1, "rollout": 2, "ref_forward": 1, "critic_forward": 1,
                                "actor_train": 2, "critic_train": 1}
    assert [stage_of_process(n) for n in ("actor_train-0.rank1", "rollout-12", "broker")] == \
        ["actor_train", "rollout", "broker"]
    assert memory_profile({"memory": {"per_process": {}}}) is None and memory_profile({}) is None


def test_the_fork_server_runs_no_stage_and_is_kept_as_measured():
    """Stage processes forked from the fork server share its pages (launch/process_start.py): their
    runtime is small and the server holds the rest, counted beside the broker's."""
    forked = {"broker": 50.0, "fork_server": 330.0, "prompts-0": 90.0, "ref_forward-0": 95.0, "actor_train-0": 240.0}
    memory = memory_profile(summary(forked))
    assert memory.runtime_mb == 90.0 and memory.other_mb == 380.0
    assert "fork_server" not in memory.own_mb and memory.own_mb["actor_train"] == 150.0


def test_device_groups_share_one_runtime():
    """Separate: 170 + 320 + 300 + 290 + 310 + 450 + 440 = 2280. The forwards in one process:
    290 + 0 + 20 = 310 for 600, so 1990; the trainers too: 290 + 160 + 150 = 600 for 890, so 1700."""
    figures = {}
    for name, groups in (("separate", {}), ("forwards", FORWARDS), ("both", BOTH)):
        figures[name] = predict(profile(), iterations=3, schedule="stream", overlap_depth=1, mode="separated",
                                groups=groups)
    assert figures["separate"].peak_host_mb == pytest.approx(2280.0)
    assert figures["forwards"].host_mb == pytest.approx({"broker": 170.0, "prompts": 320.0, "rollout": 300.0,
                                                         "forwards": 310.0, "actor_train": 450.0,
                                                         "critic_train": 440.0})
    assert figures["both"].summary()["peak_mem_mb"] == pytest.approx(1700.0)
    # on the CPU a group's stages already took turns on their side's cores: the same schedule
    assert figures["both"].iteration_s == figures["separate"].iteration_s


def test_a_profile_without_memory_predicts_none():
    p = predict(Profile(step_s={"rollout": (1.0,), "actor_train": (1.0,)}, minibatches=1,
                        inputs={"rollout": (), "actor_train": ("rollout",)}, rollout_side=frozenset({"rollout"}),
                        publish_s=0.0, weights_load_s=0.0), 2, "stream", 0, "separated")
    assert p.peak_host_mb is None and p.summary()["peak_mem_mb"] is None


def test_device_memory_of_groups_is_each_groups_largest_member():
    """On one GPU: rollout resident (2), the forwards' process holds the larger of 3 and 5, the
    trainers' the larger of 4 and 6: 2 + 5 + 6 = 13 (separate processes: 2 + 3 + 5 + 4 + 6 = 20).
    Prefetching, a group holds its two largest members while one's onload overlaps the other's step:
    2 + (3 + 5) + (4 + 6) = 20."""
    def graph(grouped: bool, prefetch: bool = False) -> SimGraph:
        def stage(name: str, gb: float, inputs: tuple[str, ...], group: str) -> SimStage:
            return SimStage(name, 0.1, inputs=inputs, device="gpu", memory_gb=gb,
                            process=group if grouped else "", offload=grouped, prefetch=prefetch)
        return SimGraph(stages=(SimStage("rollout", 1.0, side="rollout", device="gpu", memory_gb=2.0),
                                stage("ref_forward", 3.0, ("rollout",), "forwards"),
                                stage("critic_forward", 5.0, ("rollout",), "forwards"),
                                stage("actor_train", 4.0, ("ref_forward",), "trainers"),
                                stage("critic_train", 6.0, ("critic_forward",), "trainers")),
                        iterations=1, minibatches=1)
    assert simulate(graph(True)).peak_memory_gb == {"gpu": 13.0}
    assert simulate(graph(False)).peak_memory_gb == {"gpu": 20.0}
    assert simulate(graph(True, prefetch=True)).peak_memory_gb == {"gpu": 20.0}


def test_a_group_member_pays_its_load_when_its_process_switched():
    """ref (a group's, offloading, load 0.25) and reward (a process of its own) on one GPU, two
    mini-batches: rollout 0-1, 1-2; ref 1-1.75 (loads: first on its process), reward 1.75-2.25,
    ref 2.25-2.75 (its process stepped nothing else since: no load, though reward used the
    device), reward 2.75-3.25."""
    stages = (SimStage("rollout", 1.0, side="rollout"),
              SimStage("ref_forward", 0.5, inputs=("rollout",), device="gpu", process="forwards", offload=True,
                       load_s=0.25),
              SimStage("reward_forward", 0.5, inputs=("rollout",), device="gpu"),
              SimStage("actor_train", 0.0, inputs=("ref_forward", "reward_forward")))
    p = simulate(SimGraph(stages=stages, iterations=1, minibatches=2))
    assert [(s.start_s, s.end_s) for s in p.steps if s.stage == "ref_forward"] == [(1, 1.75), (2.25, 2.75)]
    assert [(s.start_s, s.end_s) for s in p.steps if s.stage == "reward_forward"] == [(1.75, 2.25), (2.75, 3.25)]


def test_a_group_pays_the_profiles_onload_seconds_per_switch():
    """The offload block's 2 s over 8 onloads: 0.25 s each time a member takes the device from the
    other; a block that moved nothing (a CPU device) costs nothing."""
    moved = {"onloads": 8, "onload_s": 2.0, "onload_mb": 80.0}
    offload = {stage: dict(moved) for stage in ("ref_forward", "critic_forward")}
    graph = profile(offload=offload).graph(2, 1, "stream", {}, groups=FORWARDS)
    assert [graph.stage(s).load_s for s in ("ref_forward", "critic_forward", "actor_train")] == [0.25, 0.25, 0.0]
    cpu = {stage: {**moved, "onload_mb": 0.0} for stage in offload}
    assert profile(offload=cpu).graph(2, 1, "stream", {}, groups=FORWARDS).stage("ref_forward").load_s == 0.0


def test_a_groups_stages_must_share_its_device():
    with pytest.raises(ValueError, match="critic_forward.device='b': process 'forwards' runs on 'a'"):
        SimGraph(stages=(SimStage("rollout", 1.0), SimStage("actor_train", 1.0),
                         SimStage("ref_forward", 1.0, device="a", process="forwards"),
                         SimStage("critic_forward", 1.0, device="b", process="forwards")),
                 iterations=1, minibatches=1)


def test_search_tries_the_groups_and_the_limit_leaves_out_what_is_over():
    """Three groupings x (sync + stream k=0..2) x 2 modes (no stage on rollout's cores); a limit of
    2000 MB keeps the grouped plans (1990 and 1700) and leaves out the 8 separate ones (2280)."""
    plans = search(profile(), iterations=4, with_rollout=[()])
    assert len(plans) == 24
    assert {tuple(p.sets[3:4]) for p in plans} == {
        ("placement.device_groups={}",),
        ("placement.device_groups={forwards: [ref_forward, critic_forward]}",),
        ("placement.device_groups={forwards: [ref_forward, critic_forward], trainers: [actor_train, critic_train]}",)}
    kept, dropped = within_memory(plans, 2000.0)
    assert dropped == 8 and len(kept) == 16
    assert sorted({p.prediction.peak_host_mb for p in kept}) == pytest.approx([1700.0, 1990.0])
    assert [p.prediction.iteration_s for p in kept] == sorted(p.prediction.iteration_s for p in kept)
    assert within_memory(plans, None) == (plans, 0)
    # equal times: no groups first (the memory a group saves buys no time)
    assert plans[0].groups == {}


def test_the_set_lines_of_every_candidate_build_the_config(tmp_path):
    """The tiny PPO job: its forwards (ref, reward, critic) and trainers; each candidate's --set
    line builds an RLJobConfig with exactly those groups."""
    config = write_job(tmp_path / "job.yaml", tiny_job(tmp_path, "grouped"))
    stages = set(preview_plan(load_config(RLJobConfig, str(config), [])).flow.stages)
    candidates = device_group_candidates(stages)
    assert candidates == [{}, {"forwards": ["ref_forward", "reward_forward", "critic_forward"]},
                          {"forwards": ["ref_forward", "reward_forward", "critic_forward"],
                           "trainers": ["actor_train", "critic_train"]}]
    plans = search(Profile(step_s={s: (0.1,) for s in stages}, minibatches=1,
                           inputs={s: () for s in stages}, rollout_side=frozenset({"prompts", "rollout"}),
                           publish_s=0.0, weights_load_s=0.0), iterations=2, max_overlap_depth=0,
                   modes=("separated",), groups=candidates)
    assert len(plans) == 2 * (5 + 4 + 2)  # with_rollout: 5 candidates, 4 leave the forwards whole, 2 both groups
    for plan in plans:
        cfg = load_config(RLJobConfig, str(config), plan.sets)
        assert cfg.placement.device_groups == plan.groups and cfg.schedule == plan.schedule
        assert cfg.placement.with_rollout == list(plan.with_rollout)
    assert buildable_groups(str(config), [], stages) == candidates


def test_groups_the_config_cannot_host_are_not_tried(tmp_path):
    """Actor training at two ranks cannot join a device group: only the forwards' group is left."""
    data = tiny_job(tmp_path, "ranked", **{"placement.stages": {"actor_train": {"ranks": 2}}})
    config = write_job(tmp_path / "job.yaml", data)
    stages = set(preview_plan(load_config(RLJobConfig, str(config), [])).flow.stages)
    assert buildable_groups(str(config), [], stages) == [{}, {"forwards": ["ref_forward", "reward_forward",
                                                                           "critic_forward"]}]
