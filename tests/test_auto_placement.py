"""`placement: auto` (`planner/auto_placement.py`): the placement chosen from the planner's inputs
(the config's workload and a fixed machine description), without running a job. The figures
below are ones this 2-core VM measured (`micro_calibration.py`, one thread), written out so that
the choice is checked against them alone."""

from __future__ import annotations

import json
import time

import pytest

from stream_rlhf.config import ConfigError, load_config
from stream_rlhf.driver.dataflow import compile_job
from stream_rlhf.driver.plan import compile_plan
from stream_rlhf.driver.replan import ReplanWatch
from stream_rlhf.planner.auto_placement import choose_placement, describe_replan, replan, with_placement
from stream_rlhf.planner.devices import DeviceFigures
from stream_rlhf.rl.config import RLJobConfig

MACHINE = DeviceFigures(name="this 2-core VM, one thread (measured once)", peak_flops=7.6e10, efficiency=0.483,
                        bandwidth=2.07e10, layer_overhead_s=4.9e-4, decode_overhead_s=5.3e-4, bytes_per_param=4,
                        link_bandwidth=2.07e10, host_bandwidth=2.07e10, memory_gb=25.0)
LONG_ANSWERS = ["rollout.stop=[]", "rollout.max_new_tokens=48", "rollout_batch.prompts_per_minibatch=4",
                "rollout_batch.minibatches=8", "algorithm.ppo_epochs=1"]
"""bench/pipeline.py's workload: 48 answer tokens, 8 mini-batches of 4 prompts."""
CRITIC = ["critic_forward", "critic_train"]


def job(*sets: str) -> tuple[RLJobConfig, object]:
    cfg = load_config(RLJobConfig, "configs/text_ppo.yaml", list(sets))
    return cfg, compile_job(cfg, "/nonexistent/checkpoint", "/dev/shm/unused", False)


def test_short_answers_put_the_critic_with_rollout_long_answers_keep_it_on_the_train_side():
    """The shipped text_ppo (answers of at most 5 tokens) and bench/pipeline.py's 48 tokens: the
    same config, the answer length decides, and the same inputs give the same choice."""
    short = choose_placement(*job(), MACHINE)
    assert short.decided == ("mode", "with_rollout", "device_groups")
    assert short.placement == {"mode": "separated", "with_rollout": CRITIC, "device_groups": {}}
    long = choose_placement(*job(*LONG_ANSWERS), MACHINE)
    assert long.placement == {"mode": "separated", "with_rollout": [], "device_groups": {}}
    assert long.workload.response_tokens == 48 and short.workload.response_tokens == 5
    for choice, sets in ((short, []), (long, LONG_ANSWERS)):
        assert choose_placement(*job(*sets), MACHINE).as_dict() == choice.as_dict()  # deterministic
        fitting = [c.iteration_s for c in choice.candidates if c.iteration_s is not None]
        assert choice.predicted_iteration_s == min(fitting) and len(fitting) == len(choice.candidates)
    assert "answers of 48 tokens" in long.describe() and "the next best" in long.describe()
    assert long.as_dict()["summary"] == long.describe()


def test_a_short_run_is_placed_for_the_long_run_s_steady_state():
    """With the forwards on rollout's cores, text_ppo's rollout side falls behind more every
    iteration: ahead over 10 iterations, behind over 40; a 10-iteration run is placed as a long one."""
    short_run = choose_placement(*job("iterations=10"), MACHINE)
    assert short_run.placement["with_rollout"] == CRITIC
    assert short_run.as_dict()["candidates"] == choose_placement(*job("iterations=40"), MACHINE).as_dict()["candidates"]


def test_an_explicit_key_is_kept_and_only_the_others_are_chosen():
    cfg, flow = job("placement.with_rollout=[critic_train]", *LONG_ANSWERS)
    choice = choose_placement(cfg, flow, MACHINE)
    assert choice.decided == ("mode", "device_groups")
    assert choice.placement["with_rollout"] == ["critic_train"]
    assert {c.placement["with_rollout"] == ["critic_train"] for c in choice.candidates if c.placement["mode"]
            == "separated"} == {True}
    given = choose_placement(*job("placement.mode=separated", "placement.with_rollout=[]",
                                  "placement.device_groups={}"), MACHINE)
    assert given.decided == () and given.predicted_iteration_s is None and given.candidates == ()
    colocated = choose_placement(*job("placement.mode=colocated"), MACHINE)  # with_rollout unused: nothing to time
    assert colocated.device is MACHINE and colocated.predicted_iteration_s is None
    assert colocated.placement == {"mode": "colocated", "with_rollout": [], "device_groups": {}}


def test_a_placement_that_cannot_fit_is_never_chosen():
    """A device group given explicitly: the with_rollout candidates that would split it between the
    sides are not tried; models larger than the machine's memory: none fits, and the error says so."""
    cfg, flow = job("placement.device_groups={scores: [reward_forward, critic_forward]}")
    choice = choose_placement(cfg, flow, MACHINE)
    for candidate in choice.candidates:
        moved = set(candidate.placement["with_rollout"])
        assert not moved & {"reward_forward", "critic_forward"} or {"reward_forward", "critic_forward"} <= moved
    small = DeviceFigures(**{**MACHINE.__dict__, "memory_gb": 1e-4})
    with pytest.raises(ConfigError, match=r"no placement fits this machine: .*its models need 0\.\d GB, 0\.0001 GB"):
        choose_placement(cfg, flow, small)


def test_the_plan_places_the_processes_as_chosen_and_records_why():
    cfg, flow = job()
    choice = choose_placement(cfg, flow, MACHINE)
    placed = with_placement(cfg, choice.chosen)
    assert placed.placement.auto == () and placed.placement.with_rollout == CRITIC
    plan = compile_plan(placed, "/nonexistent/checkpoint", "/dev/shm/unused", False,
                        placement_auto=choice.as_dict())
    cores = {r["stage"]: r["cores"] for r in plan.as_dict()["ranks"]}
    assert cores["critic_forward"] == cores["critic_train"] == cores["rollout"] != cores["actor_train"]
    assert plan.as_dict()["placement_auto"]["placement"]["with_rollout"] == CRITIC
    assert "placement auto: mode=separated, with_rollout=[critic_forward, critic_train]" in plan.describe()


def test_replan_names_a_faster_placement_when_the_answers_turn_out_shorter():
    """Planned for 48-token answers; the run measures 3-token ones (the policy learned to stop):
    a critic stage on rollout's cores is predicted faster, and the log line names the --set."""
    cfg, flow = job(*LONG_ANSWERS)
    choice = choose_placement(cfg, flow, MACHINE)
    running = with_placement(cfg, choice.chosen)
    drift = replan(running, flow, choice, response_tokens=3.0, measured_iteration_s=0.7, iterations=5)
    moved = drift["better"]["with_rollout"]
    assert moved and set(moved) <= set(CRITIC)
    assert drift["better"]["predicted_iteration_s"] < drift["running_predicted_now_s"] * 0.9
    assert f"--set placement.with_rollout=[{', '.join(moved)}]" in describe_replan(drift)
    same = replan(running, flow, choice, response_tokens=48.0, measured_iteration_s=0.7, iterations=5)
    assert same["better"] is None
    assert same["running_predicted_now_s"] == pytest.approx(choice.predicted_iteration_s, abs=1e-4)
    watch = ReplanWatch(running, flow, choice, metrics_path=None)
    records = [{"iteration": i, "iteration_s": 2.0 if i == 0 else 0.5, "response_len": 3.0} for i in range(5)]
    watch.check(records, done=5)
    assert watch.result["measured_iteration_s"] == 0.5  # the first iteration (start-up) left out
    assert watch.result["better"]["with_rollout"] == moved
    assert watch.result["switch"]["switched"] is False and watch.switch is None  # placement.replan=warn


def test_the_replan_counts_the_actors_iterations_not_a_critic_warm_ups(tmp_path):
    """A warm-up's metrics lines (`critic_warmup: 1`) have no answer length: the watch waits for
    placement.replan_after of the actor's own iterations (it once read the warm-up's and died)."""
    cfg, flow = job(*LONG_ANSWERS, "critic.warmup_iterations=3", "placement.replan_after=2")
    choice = choose_placement(cfg, flow, MACHINE)
    metrics = tmp_path / "metrics.jsonl"
    lines = [{"iteration": i, "critic_warmup": 1, "iteration_s": 0.4, "samples": 32} for i in range(3)]
    lines += [{"iteration": 3 + i, "iteration_s": 0.7, "response_len": 3.0} for i in range(2)]
    with ReplanWatch(with_placement(cfg, choice.chosen), flow, choice, metrics, every_s=0.01) as watch:
        metrics.write_text("".join(json.dumps(line) + "\n" for line in lines[:4]))
        time.sleep(0.2)
        assert watch.result is None  # 4 lines, one of them the actor's
        metrics.write_text("".join(json.dumps(line) + "\n" for line in lines))
        deadline = time.monotonic() + 10
        while watch.result is None and time.monotonic() < deadline:
            time.sleep(0.01)
    assert watch.result is not None and watch.result["measured_iteration_s"] == 0.7
    assert watch.result["better"]["with_rollout"]  # the answers measured 3 tokens, not 48


def test_placement_auto_is_the_default_and_takes_keys_set_over_it(tmp_path):
    config = tmp_path / "job.yaml"
    config.write_text("name: auto\nplacement: auto\n")
    cfg = load_config(RLJobConfig, config, ["placement.with_rollout=[critic_train]"])
    assert cfg.placement.auto == ("mode", "device_groups") and cfg.placement.with_rollout == ["critic_train"]
    assert load_config(RLJobConfig, config).placement.auto == ("mode", "with_rollout", "device_groups")
    with pytest.raises(ConfigError, match=r"placement.with_rollout='soon': expected a list"):
        load_config(RLJobConfig, config, ["placement.with_rollout=soon"])


def test_ray_stage_resources_keep_the_fallback():
    """Stages pinned to nodes by ray.stage_resources are not moved to rollout's cores."""
    cfg, flow = job("launcher=ray", "ray.stage_resources={critic_train: {train_node: 1}}")
    choice = choose_placement(cfg, flow, MACHINE)
    assert choice.placement == {"mode": "separated", "with_rollout": [], "device_groups": {}}
    assert choice.predicted_iteration_s is None and "ray.stage_resources" in choice.describe()


def test_an_env_job_is_planned_with_every_turn_within_the_episode_budget():
    """The shipped tool job: each of env.max_turns turns at rollout.max_new_tokens, capped by what
    env.max_episode_tokens leaves after the prompt; the summary says where the length came from,
    and a replan's measured length is named as measured."""
    cfg = load_config(RLJobConfig, "configs/text_tool_grpo.yaml", [])
    flow = compile_job(cfg, "/nonexistent/checkpoint", "/dev/shm/unused", False)
    choice = choose_placement(cfg, flow, MACHINE)
    env, turn = cfg.env, cfg.rollout.max_new_tokens
    expected = min(env.max_turns * turn, env.max_episode_tokens - choice.workload.prompt_tokens)
    assert choice.workload.response_tokens == expected > turn
    assert "(env.max_turns x rollout.max_new_tokens, within env.max_episode_tokens)" in choice.describe()
    measured = choose_placement(cfg, flow, MACHINE, response_tokens=21.5)
    assert "answers of 21.5 tokens (measured)" in measured.describe()
