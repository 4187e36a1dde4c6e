"""`stream-rlhf plan CONFIG --profile RUN_DIR [--search]`: the simulator's prediction from a run's
trace. The trace here is itself simulated (a known graph over the job's own stages and edges,
written as the merged trace.json of a run), so calibrating on it and simulating the same
schedule must give back the same figures."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from stream_rlhf.cli import main
from stream_rlhf.config import load_config
from stream_rlhf.driver.dataflow import ROLLOUT_SIDE, on_rollout_cores
from stream_rlhf.driver.plan import preview_plan
from stream_rlhf.planner.graph import SimGraph, SimStage
from stream_rlhf.planner.simulator import simulate, trace_event
from stream_rlhf.rl.config import RLJobConfig
from stream_rlhf.telemetry.trace_merge import topic_sources
from tests.rl_tiny import tiny_job, write_job

COSTS = {"prompts": 0.01, "rollout": 1.0, "ref_forward": 0.2, "reward_forward": 0.01, "critic_forward": 0.2,
         "actor_train": 0.6, "critic_train": 0.5}


def job_graph(config: Path) -> SimGraph:
    """The tiny PPO job's stages with made-up costs, edges as its broker routes the topics, on the
    cores the config gives them (`placement.with_rollout`'s on rollout's)."""
    cfg = load_config(RLJobConfig, str(config), [])
    flow = preview_plan(cfg).flow
    sources = topic_sources(flow.topology)
    inputs = {stage: sorted({p for topic, t in flow.topology.topics.items() if stage in t.consumers
                             for p in sources[topic]}) for stage in flow.stages}
    assert set(inputs) == set(COSTS), sorted(inputs)
    stages = tuple(SimStage(name, COSTS[name], inputs=tuple(inputs[name]),
                            side="rollout" if name in ROLLOUT_SIDE else "train",
                            device="rollout cores" if on_rollout_cores(cfg, name) else "train cores")
                   for name in COSTS)
    return SimGraph(stages=stages, iterations=cfg.iterations, minibatches=cfg.rollout_batch.minibatches,
                    overlap_depth=cfg.overlap_depth)


def write_trace(graph: SimGraph, run_dir: Path) -> float:
    """trace.json of the simulated run: a track per stage, flow arrows along the edges."""
    prediction = simulate(graph)
    steps = {(s.stage, s.iteration, s.minibatch): s for s in prediction.steps}
    events = [{"ph": "M", "name": "process_name", "pid": stage.name, "tid": 0, "args": {"name": f"{stage.name}-0"}}
              for stage in graph.stages]
    events += [trace_event(step) for step in prediction.steps]
    for name, _iteration, _minibatch in steps:
        for source in graph.stage(name).inputs:
            flow = len(events)
            events += [{"ph": "s", "id": flow, "pid": source, "ts": 0, "name": "minibatch"},
                       {"ph": "f", "id": flow, "pid": name, "ts": 0, "name": "minibatch"}]
    run_dir.mkdir()
    (run_dir / "trace.json").write_text(json.dumps({"traceEvents": events}))
    return prediction.iteration_s


@pytest.fixture
def config(tmp_path) -> Path:
    return write_job(tmp_path / "job.yaml", tiny_job(tmp_path, "planned", schedule="stream", overlap_depth=1,
                                                     iterations=6, **{"placement.mode": "separated",
                                                                      "placement.with_rollout": []}))


def test_a_profile_of_the_same_schedule_predicts_its_own_figures(config, tmp_path, capsys):
    iteration_s = write_trace(job_graph(config), tmp_path / "calibration")
    assert main(["plan", str(config), "--profile", str(tmp_path / "calibration"), "--search", "--json"]) == 0
    out = capsys.readouterr().out
    result = json.loads(out.strip().splitlines()[-1])
    assert result["prediction"]["iteration_s"] == pytest.approx(iteration_s, abs=1e-4)
    assert 0 <= result["prediction"]["bubble_ratio"] <= 1
    assert len(result["plans"]) == 3
    times = [plan["iteration_s"] for plan in result["plans"]]
    assert times == sorted(times) and times[0] <= result["prediction"]["iteration_s"] + 1e-9
    assert all(plan["sets"][0].startswith("schedule=") for plan in result["plans"])
    assert "best plans" in out and "--set schedule=" in out


def test_a_profile_of_other_stages_is_refused_naming_them(config, tmp_path, capsys):
    graph = job_graph(config)
    write_trace(SimGraph(stages=graph.stages[:2] + (SimStage("actor_train", 0.5, inputs=("rollout",)),),
                         iterations=6, minibatches=graph.minibatches), tmp_path / "other")
    assert main(["plan", str(config), "--profile", str(tmp_path / "other")]) == 2
    assert "missing: ['critic_forward', 'critic_train', 'ref_forward', 'reward_forward']" in capsys.readouterr().err


def test_a_profile_with_actor_forward_predicts_a_config_without_it(config, tmp_path, capsys):
    """A run at overlap_depth 0 has actor_forward (0.2 s a mini-batch); the config (k=1) has not:
    its cost moves into actor_train's last mini-batch, and the prediction is that graph's."""
    graph = job_graph(config)
    forward = SimStage("actor_forward", 0.2, inputs=("rollout",), device="train cores")
    stages = [s if not s.name.endswith("_train") else SimStage(s.name, s.step_s, inputs=(*s.inputs, "actor_forward"),
                                                                device=s.device) for s in graph.stages]
    write_trace(SimGraph(stages=(*stages[:3], forward, *stages[3:]), iterations=graph.iterations,
                         minibatches=graph.minibatches, overlap_depth=0), tmp_path / "k0")
    assert main(["plan", str(config), "--profile", str(tmp_path / "k0"), "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    n = graph.minibatches
    moved = tuple(s if s.name != "actor_train" else SimStage(s.name, (0.6,) * (n - 1) + (0.6 + 0.2 * n,),
                                                               inputs=s.inputs, device=s.device) for s in graph.stages)
    expected = simulate(SimGraph(stages=moved, iterations=graph.iterations, minibatches=n, overlap_depth=1))
    assert result["prediction"]["iteration_s"] == pytest.approx(expected.iteration_s, abs=1e-3)


def test_a_profile_needs_a_trace_and_no_device_figures(config, tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert main(["plan", str(config), "--profile", str(tmp_path / "empty"), "--device", "h100"]) == 2
    assert "--device, --prompt-tokens, --response-tokens: for analytic costs, not with --profile" \
        in capsys.readouterr().err
    assert main(["plan", str(config), "--profile", str(tmp_path / "empty")]) == 2
    assert "no trace.json there" in capsys.readouterr().err


def test_a_config_with_stages_on_rollouts_cores_predicts_its_own_run(tmp_path, capsys):
    """The critic's stages on rollout's cores (`placement.with_rollout`): calibrated on a run placed
    so, the config as given gives back that run's iteration time (the profile's devices are the
    config's). Here the move does not pay: rollout's cores carry 2 x (0.01 + 1.0 + 0.2 + 0.5) =
    3.42 s of work an iteration, against 2 x 1.51 = 3.02 on the train cores with the critic there,
    and the same costs placed so run faster."""
    config = write_job(tmp_path / "job.yaml", tiny_job(
        tmp_path, "moved", schedule="stream", overlap_depth=1, iterations=6,
        **{"placement.mode": "separated", "placement.with_rollout": ["critic_forward", "critic_train"]}))
    graph = job_graph(config)
    assert graph.stage("critic_train").device == "rollout cores" and graph.stage("critic_train").side == "train"
    iteration_s = write_trace(graph, tmp_path / "calibration")
    assert main(["plan", str(config), "--profile", str(tmp_path / "calibration"), "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["prediction"]["iteration_s"] == pytest.approx(iteration_s, abs=1e-4)
    on_train_side = SimGraph(stages=tuple(replace(stage, device="rollout cores" if stage.side == "rollout"
                                                  else "train cores") for stage in graph.stages),
                             iterations=graph.iterations, minibatches=graph.minibatches,
                             overlap_depth=graph.overlap_depth)
    assert simulate(on_train_side).iteration_s < iteration_s - 0.1


def test_a_run_placed_otherwise_than_the_config_is_refused(config, tmp_path, capsys):
    """The run's plan.json put critic_train on rollout's cores (core 0), the config does not: the
    profile would read its steps as the train side's, so plan refuses and names the --set line."""
    write_trace(job_graph(config), tmp_path / "calibration")
    cores = {stage: [0] if stage in ("prompts", "rollout", "critic_train") else [1] for stage in COSTS}
    ranks = [{"stage": stage, "rank": 0, "cores": on} for stage, on in cores.items()]
    (tmp_path / "calibration" / "plan.json").write_text(json.dumps({"ranks": ranks}))
    assert main(["plan", str(config), "--profile", str(tmp_path / "calibration")]) == 2
    assert ("the run had ['critic_train'] on rollout's cores, this config none; calibrate on a run placed as the "
            "config is, or give --set 'placement.with_rollout=[critic_train]'") in capsys.readouterr().err
    assert main(["plan", str(config), "--profile", str(tmp_path / "calibration"),
                 "--set", "placement.with_rollout=[critic_train]"]) == 0


def test_search_tries_device_groups_within_a_memory_limit(config, tmp_path, capsys):
    """Each stage process 300 MB (reward_forward's, the runtime, 280), the broker 170: separate
    170 + 7 x 300 - 20 = 2250 MB; the forwards in one process 2250 - 2 x 280 = 1690; the trainers
    too 1690 - 280 = 1410. Under 1500 MB only the last is left. Placements: separated with 5
    with_rollout candidates (4 leave the forwards' group whole, 2 both groups), colocated with
    none: 6 + 5 + 3, x 4 schedules; 44 plans left out, 12 kept."""
    write_trace(job_graph(config), tmp_path / "calibration")
    pss = {f"{stage}-0": 280.0 if stage == "reward_forward" else 300.0 for stage in COSTS} | {"broker": 170.0}
    memory = {"per_process": {name: {"peak_pss_mb": mb} for name, mb in pss.items()}}
    (tmp_path / "calibration" / "summary.json").write_text(json.dumps({"memory": memory}))
    assert main(["plan", str(config), "--profile", str(tmp_path / "calibration"), "--search", "--top", "30",
                 "--memory-limit-mb", "1500", "--json"]) == 0
    out = capsys.readouterr().out
    result = json.loads(out.strip().splitlines()[-1])
    assert result["prediction"]["peak_mem_mb"] == pytest.approx(2250.0)
    assert result["plans_over_memory_limit"] == 44 and len(result["plans"]) == 12
    assert [plan["peak_mem_mb"] for plan in result["plans"]] == pytest.approx([1410.0] * 12)
    assert {plan["sets"][4] for plan in result["plans"]} == {
        "placement.with_rollout=[]", "placement.with_rollout=[ref_forward, reward_forward, critic_forward]"}
    assert all(plan["sets"][3] == "placement.device_groups={forwards: [ref_forward, reward_forward, critic_forward], "
               "trainers: [actor_train, critic_train]}" for plan in result["plans"])
    assert "44 plan(s) left out: predicted over --memory-limit-mb 1500" in out
    assert "--set 'placement.device_groups={forwards:" in out


def test_a_limit_needs_memory_figures_and_a_grouped_run_is_no_profile(config, tmp_path, capsys):
    write_trace(job_graph(config), tmp_path / "calibration")
    assert main(["plan", str(config), "--profile", str(tmp_path / "calibration"), "--search",
                 "--memory-limit-mb", "1500"]) == 2
    assert "summary.json has no memory block" in capsys.readouterr().err
    trace = tmp_path / "calibration" / "trace.json"
    events = json.loads(trace.read_text())["traceEvents"]
    for event in events:
        if event.get("name") == "process_name" and event["pid"] in ("ref_forward", "critic_forward"):
            event["args"]["name"] = "forwards-0"
    trace.write_text(json.dumps({"traceEvents": events}))
    assert main(["plan", str(config), "--profile", str(tmp_path / "calibration")]) == 2
    assert "processes ['forwards'] each ran several stages" in capsys.readouterr().err
