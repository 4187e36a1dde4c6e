"""The job plan: compiled once, printed by `stream-rlhf plan` without starting anything, read by
`stream-rlhf stage` (which never warm-starts), carried out by the launcher the config names."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stream_rlhf.cli import main
from stream_rlhf.config import ConfigError, build, load_config
from stream_rlhf.driver.plan import preview_plan
from stream_rlhf.launch.launcher import make_launcher
from stream_rlhf.launch.local import LocalJob
from stream_rlhf.launch.ray_config import RayConfig
from stream_rlhf.rl.config import RLJobConfig
from tests.rl_tiny import VISION, tiny_job, write_job

ROOT = Path(__file__).resolve().parent.parent


def fresh_cache_job(tmp_path: Path, **overrides) -> dict:
    """A tiny job whose warm start is not cached anywhere yet (a cache folder of its own)."""
    return tiny_job(tmp_path, "fresh", **{"model.warm_start.cache_dir": str(tmp_path / "cache"), **overrides})


def test_plan_prints_every_process_and_what_was_left_out_and_starts_nothing(tmp_path, capsys):
    config = write_job(tmp_path / "job.yaml", fresh_cache_job(tmp_path, **{"algorithm.advantage": "grpo",
                                                                         "algorithm.lam": 0.95,
                                                                         "rollout_batch.samples_per_prompt": 2}))
    assert main(["plan", str(config), "--json"]) == 0
    out = capsys.readouterr().out.splitlines()
    plan = json.loads(out[-1])
    assert plan["launcher"] == "local"
    assert [r["process"] for r in plan["ranks"]] == ["broker", "prompts-0", "rollout-0", "ref_forward-0",
                                                     "reward_forward-0", "actor_train-0"]
    assert set(plan["stages_left_out"]) == {"critic_forward", "actor_forward"}
    assert "has no critic" in plan["stages_left_out"]["critic_forward"]
    assert plan["checkpoint"]["ready"] is False  # the warm start is the driver's, later
    assert plan["topics"]["experience"]["join"] == ["rollout", "ref_logp", "reward"]
    text = "\n".join(out[:-1])
    assert "left out: critic_forward: algorithm.advantage=grpo has no critic" in text
    assert "not there yet: the driver warm-starts it once" in text
    assert not (tmp_path / "cache").exists() and not (tmp_path / "fresh").exists()  # nothing trained or written


def test_the_plan_of_a_shapes_job_whose_prompt_files_are_not_written_yet_writes_none(tmp_path, capsys):
    """The shapes task's files are the driver's to write; the plan says where, and that the warm
    start's folder is named once they exist (its cache key hashes them)."""
    data = fresh_cache_job(tmp_path, **VISION)
    data["task"]["data_dir"] = str(tmp_path / "data")
    assert main(["plan", write_job(tmp_path / "job.yaml", data).as_posix(), "--json"]) == 0
    plan = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert plan["dataset"]["ready"] is False and plan["dataset"]["train"].startswith(str(tmp_path / "data"))
    assert plan["checkpoint"]["path"].endswith("tiny-<its key, once the prompt files are written>")
    assert not (tmp_path / "data").exists() and not (tmp_path / "cache").exists()


def test_each_core_set_is_shared_out_among_its_processes_never_over(tmp_path):
    for mode in ("separated", "colocated"):
        plan = preview_plan(load_config(RLJobConfig, str(ROOT / "configs" / "text_ppo.yaml"),
                                        [f"placement.mode={mode}", "placement.rollout_cores=[0]",
                                         "placement.train_cores=[1]"]))
        by_cores: dict[tuple, list[float]] = {}
        for rank in plan.ranks():
            by_cores.setdefault(tuple(rank.cores), []).append(rank.cpus)
        for cores, shares in by_cores.items():
            assert sum(shares) <= len(cores) and sum(shares) > len(cores) - 0.01, (mode, cores, shares)
    assert {tuple(r.cores) for r in plan.ranks()} == {(0, 1)}  # colocated: every process on both cores


def test_overlapping_core_sets_ask_for_no_more_cpus_than_the_cores():
    """Colocated, a two-rank trainer's ranks get one core each beside processes on both: each core
    is shared out among every process pinned to it (it was counted once per core set: 4 CPUs)."""
    plan = preview_plan(load_config(RLJobConfig, str(ROOT / "configs" / "text_ppo.yaml"),
                                    ["placement.mode=colocated", "placement.stages={actor_train: {ranks: 2}}"]))
    ranks = plan.ranks()
    assert {tuple(r.cores) for r in ranks if r.stage == "actor_train"} == {(0,), (1,)}
    assert 1.99 < sum(r.cpus for r in ranks) <= 2
    on_both = [r.cpus for r in ranks if tuple(r.cores) == (0, 1)]
    on_one = [r.cpus for r in ranks if len(r.cores) == 1]
    assert len(set(on_both)) == 1 and len(set(on_one)) == 1 and on_one[0] < on_both[0]


def test_stage_refuses_to_start_before_the_driver_made_the_warm_start(tmp_path, capsys):
    config = write_job(tmp_path / "job.yaml", fresh_cache_job(tmp_path))
    assert main(["stage", str(config), "rollout", "--broker", "tcp://127.0.0.1:1"]) == 2
    err = capsys.readouterr().err
    assert "the warm start is not there yet; the driver makes it once" in err
    assert not (tmp_path / "cache").exists()  # the stage did not warm-start on its own


def test_stage_names_an_unknown_stage_or_index(tmp_path, capsys):
    config = write_job(tmp_path / "job.yaml", fresh_cache_job(tmp_path))
    assert main(["stage", str(config), "critic", "--broker", "tcp://127.0.0.1:1"]) == 2
    assert "stage 'critic' is not in this job's stages" in capsys.readouterr().err


def test_launcher_follows_the_config_and_ray_settings_need_it(tmp_path):
    cfg = build(RLJobConfig, tiny_job(tmp_path, "l"))
    assert isinstance(make_launcher(preview_plan(cfg)), LocalJob)
    ray_cfg = build(RLJobConfig, tiny_job(tmp_path, "r", launcher="ray", ray={"strategy": "SPREAD"}))
    plan = preview_plan(ray_cfg)
    assert plan.launcher == "ray" and plan.as_dict()["ray"]["strategy"] == "SPREAD"
    with pytest.raises(ConfigError, match="ray: set, but launcher=local never reads it"):
        build(RLJobConfig, tiny_job(tmp_path, "x", ray={"strategy": "SPREAD"}))
    with pytest.raises(ConfigError, match="ray.stage_resources.critic: not a stage"):
        build(RLJobConfig, tiny_job(tmp_path, "x", launcher="ray", ray={"stage_resources": {"critic": {"a": 1}}}))
    with pytest.raises(ConfigError, match="ray.stage_resources.rollout.CPU: CPUs and GPUs come from the plan"):
        RayConfig(stage_resources={"rollout": {"CPU": 1}})
    with pytest.raises(ConfigError, match="ray.strategy='FILL': one of PACK"):
        RayConfig(strategy="FILL")
    with pytest.raises(ConfigError, match="ray.num_cpus=2: only for a local instance"):
        RayConfig(address="auto", num_cpus=2)


def test_stage_resources_pin_the_bundles_of_a_stage(tmp_path):
    cfg = build(RLJobConfig, tiny_job(tmp_path, "r", launcher="ray",
                                      ray={"stage_resources": {"rollout": {"rollout_node": 1}}}))
    ranks = {r.name: r for r in preview_plan(cfg).ranks()}
    assert ranks["rollout-0"].resources == {"rollout_node": 1}
    assert ranks["rollout-0"].node("ray") == "a node with rollout_node=1"
    assert ranks["actor_train-0"].node("ray") == "any node" and ranks["actor_train-0"].resources == {}


def test_processes_on_one_gpu_share_it_out():
    from stream_rlhf.broker.control.topology import BrokerConfig, TopicConfig, Topology
    from stream_rlhf.launch.plan import Dataflow, JobPlan
    from stream_rlhf.launch.spec import StageSpec

    topics = {"a": TopicConfig(producers=["p"], consumers=["t"])}
    stages = {"p": StageSpec("tests.stages:CountingSource", devices=["cuda:0"]),
              "t": StageSpec("tests.stages:Sink", ranks=2, devices=["cuda:0", "cuda:1"])}
    ranks = {r.name: r for r in JobPlan("g", Dataflow(Topology(topics), BrokerConfig(), stages, None)).ranks()}
    assert (ranks["p-0"].gpus, ranks["t-0"].gpus, ranks["t-0.rank1"].gpus, ranks["broker"].gpus) == (0.5, 0.5, 1, 0)
