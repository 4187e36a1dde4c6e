"""Device groups under `launcher: ray`, without starting Ray: the plan holds a group as one process
(one bundle) listing its members, its bundle asks for its members' resources, and the launcher
counts each member as on the group's host and restarts the group as a whole."""

from __future__ import annotations

import json

import pytest

from stream_rlhf.cli import main
from stream_rlhf.config import build
from stream_rlhf.driver.plan import preview_plan
from stream_rlhf.launch.spec import StageFailed
from stream_rlhf.rl.config import RLJobConfig
from tests.rl_tiny import tiny_job, write_job

FORWARDS = {"forwards": ["ref_forward", "reward_forward", "critic_forward"]}
POLICIES = {"policies": ["actor_forward", "ref_forward"]}


def ray_job(tmp_path, name: str, **overrides) -> dict:
    return tiny_job(tmp_path, name, launcher="ray", **overrides)


def test_the_plan_runs_a_device_group_as_one_process_in_one_bundle(tmp_path, capsys):
    config = write_job(tmp_path / "g.yaml", ray_job(tmp_path, "g", **{"placement.device_groups": FORWARDS}))
    assert main(["plan", str(config), "--json"]) == 0
    out = capsys.readouterr().out.splitlines()
    plan = json.loads(out[-1])
    processes = [r["process"] for r in plan["ranks"]]
    assert processes == ["broker", "prompts-0", "rollout-0", "forwards-0", "actor_train-0", "critic_train-0"]
    assert plan["ray"]["bundles"] == 6  # one per process: 8 without the group
    group = plan["ranks"][3]
    assert (group["stage"], group["instance"], group["rank"]) == ("forwards", "forwards-0", 0)
    assert group["hosts"] == ["ref_forward", "reward_forward", "critic_forward"]
    line = next(line for line in out if line.strip().startswith("forwards-0"))
    assert line.endswith("hosts ref_forward, reward_forward, critic_forward")


def test_a_group_bundle_asks_for_its_members_resources(tmp_path):
    pinned = {m: {"forwards_node": 1} for m in FORWARDS["forwards"]}
    cfg = build(RLJobConfig, ray_job(tmp_path, "r", **{"placement.device_groups": FORWARDS,
                                                       "ray": {"stage_resources": pinned}}))
    ranks = {r.name: r for r in preview_plan(cfg).ranks()}
    assert ranks["forwards-0"].resources == {"forwards_node": 1}
    assert ranks["forwards-0"].node("ray") == "a node with forwards_node=1"
    assert ranks["actor_train-0"].resources == {}



def ray_launcher(tmp_path, name: str, **overrides):
    from stream_rlhf.launch.ray_job import RayJob

    pytest.importorskip("ray", reason="the ray extra is not installed (pip install -e '.[ray]')")
    return RayJob(preview_plan(build(RLJobConfig, ray_job(tmp_path, name, **overrides))))


def test_a_group_member_counts_as_on_the_group_process_host(tmp_path):
    """actor_forward reads actor_train's /dev/shm store: in a group on another host than actor_train
    the job fails naming the pair; on the same host it starts."""
    job = ray_launcher(tmp_path, "h", **{"placement.device_groups": POLICIES, "overlap_depth": 0})
    assert ("actor_forward", "actor_train") in {(a, b) for a, b, _ in job.plan.same_host}
    assert job._process_names("policies", 0) == ["policies-0"]
    job.placed = {"policies-0": {"host_id": "a"}, "actor_train-0": {"host_id": "a"}, "rollout-0": {"host_id": "a"}}
    job._check_same_host()
    job.placed["actor_train-0"] = {"host_id": "b"}
    with pytest.raises(StageFailed, match=r"actor_forward \(on a\) and actor_train \(on b\) must share a host"):
        job._check_same_host()
    assert job.failed == ["actor_forward", "actor_train"]


def test_a_group_restarts_only_while_every_member_may(tmp_path):
    job = ray_launcher(tmp_path, "s", **{"placement.device_groups": FORWARDS,
                                         "restarts": {"ref_forward": 3, "reward_forward": 1, "critic_forward": 2}})
    assert job.restarts_left["forwards"] == 1
    assert job._restart_spec("forwards").restarts == 1 and job._restart_spec("rollout").restarts == 2


def test_a_group_of_two_rank_members_is_a_process_and_a_bundle_per_rank(tmp_path):
    two = {"ref_forward": {"ranks": 2}, "critic_forward": {"ranks": 2}}
    job = ray_launcher(tmp_path, "k", **{"placement.device_groups": {"forwards": list(two)}, "placement.stages": two})
    ranks = [r for r in job.plan.ranks() if r.stage == "forwards"]
    assert [(r.name, r.rank) for r in ranks] == [("forwards-0", 0), ("forwards-0.rank1", 1)]
    assert job._process_names("forwards", 0) == ["forwards-0", "forwards-0.rank1"]
    hosts = {r["process"]: r.get("hosts") for r in job.plan.as_dict()["ranks"]}
    assert hosts["forwards-0.rank1"] == ["ref_forward", "critic_forward"]
