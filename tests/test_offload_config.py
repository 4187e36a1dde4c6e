"""Offload policies and device groups in the config: bad ones fail before launch naming the key; good
ones compile into one process per group with each member's policy."""

from __future__ import annotations

import pytest

from stream_rlhf.config import ConfigError, build
from stream_rlhf.driver.dataflow import compile_job
from stream_rlhf.launch.plan import JobPlan
from stream_rlhf.rl.config import RLJobConfig
from stream_rlhf.weights.offload_config import OffloadPolicy
from tests.rl_tiny import tiny_job

FORWARDS = {"forwards": ["ref_forward", "critic_forward"]}


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"placement.stages": {"rollout": {"offload": {"what": ["params"]}}}},
         "placement.stages.rollout.offload: rollout holds no model on a device to offload"),
        ({"placement.stages": {"reward_forward": {"offload": {}}}},
         "placement.stages.reward_forward.offload: reward_forward holds no model"),
        ({"placement.stages": {"ref_forward": {"offload": {"what": ["params", "optimizer"]}}}},
         "placement.stages.ref_forward.offload.what=['params', 'optimizer']: ref_forward is forward-only, it keeps "
         "no optimizer"),
        ({"placement.stages": {"critic_forward": {"offload": {"what": ["grads"]}}}},
         "critic_forward is forward-only, it keeps no grads"),
        ({"placement.stages": {"ref_forward": {"offload": {"what": []}}}},
         "placement.stages.ref_forward.offload.what=[]: name at least one"),
        ({"placement.stages": {"ref_forward": {"offload": {"what": ["kv_cache"]}}}},
         "placement.stages.ref_forward.offload.what[0]='kv_cache': must be one of"),
        ({"placement.stages": {"ref_forward": {"offload": {"when": "epoch"}}}},
         "placement.stages.ref_forward.offload.when='epoch': must be one of"),
        ({"placement.stages": {"ref_forward": {"offload": {"when": "switch"}}}},
         "placement.stages.ref_forward.offload.when=switch: ref_forward is in no placement.device_groups entry"),
        ({"placement.stages": {"ref_forward": {"offload": {"prefetch": True}}}},
         "placement.stages.ref_forward.offload.prefetch=true: ref_forward is in no placement.device_groups entry"),
        ({"placement.device_groups": {"solo": ["ref_forward"]}},
         "placement.device_groups.solo=['ref_forward']: a device group hosts two stages or more"),
        ({"placement.device_groups": {"a": ["ref_forward", "critic_forward"], "b": ["ref_forward", "actor_train"]}},
         "placement.device_groups.b: ref_forward is in device group a already"),
        ({"placement.device_groups": {"ref_forward": ["actor_train", "critic_train"]}},
         "placement.device_groups.ref_forward: the group's name is a stage's"),
        ({"placement.device_groups": {"g": ["rollout", "ref_forward"]}},
         "placement.device_groups.g: 'rollout' cannot join a device group"),
        ({"placement.device_groups": FORWARDS, "placement.stages": {"ref_forward": {"ranks": 2}}},
         "placement.device_groups.forwards: its stages share one process, so one ranks setting: "
         "stages.ref_forward.ranks=2, stages.critic_forward.ranks=1"),
        ({"placement.device_groups": FORWARDS,
          "placement.stages": {"ref_forward": {"backend": "megatron", "ranks": 2, "megatron": {"tp": 2}},
                               "critic_forward": {"backend": "megatron", "ranks": 2}}},
         "placement.device_groups.forwards: its megatron stages share one process and so megatron's parallel "
         "state, so one tp, pp and cp: stages.ref_forward.megatron={tp: 2, pp: 1, cp: 1}, "
         "stages.critic_forward.megatron={tp: 1, pp: 1, cp: 1}"),
        ({"placement.device_groups": FORWARDS, "placement.with_rollout": ["critic_forward"],
          "placement.mode": "separated"},
         "placement.with_rollout=['critic_forward']: critic_forward of device_groups.forwards would run on rollout's "
         "cores, ref_forward on the train side's, but a group's stages share one process: name all of its stages "
         "or none"),
        ({"placement.device_groups": FORWARDS, "placement.stages": {"ref_forward": {"cores": [0]}}},
         "placement.device_groups.forwards: its stages share one process, so one cores setting: "
         "stages.ref_forward.cores=[0], stages.critic_forward.cores=None"),
        ({"placement.device": "cuda", "placement.stages": {"actor_train": {"ranks": 2, "offload": {}}}},
         "placement.stages.actor_train.offload: actor_train has ranks=2 on the torch backend on CUDA: its model is "
         "sharded over them (FSDP2), and moving a sharded model off the device is not built yet"),
        ({"placement.device": "cuda", "placement.device_groups": {"trainers": ["actor_train", "critic_train"]},
          "placement.stages": {"actor_train": {"ranks": 2}, "critic_train": {"ranks": 2}}},
         "placement.device_groups.trainers: its members take turns on the device by offloading, and actor_train "
         "has ranks=2 on the torch backend on CUDA"),
        ({"placement.device_groups": FORWARDS, "launcher": "ray",
          "ray": {"stage_resources": {"ref_forward": {"a": 1}}}},
         "placement.device_groups.forwards: its stages share one process, one Ray bundle on one node, so one "
         "ray.stage_resources setting: ray.stage_resources.ref_forward={'a': 1.0}, "
         "ray.stage_resources.critic_forward=None"),
    ],
)
def test_bad_offload_or_device_group_names_the_key(tmp_path, override, message):
    with pytest.raises(ConfigError) as err:
        build(RLJobConfig, tiny_job(tmp_path, "bad", **override))
    assert message in str(err.value)


def test_a_device_group_is_one_process_and_its_members_take_turns(tmp_path):
    cfg = build(RLJobConfig, tiny_job(tmp_path, "g", **{
        "placement.device_groups": {"forwards": ["ref_forward", "critic_forward", "reward_forward"],
                                    "trainers": ["actor_train", "critic_train"]},
        "placement.stages": {"ref_forward": {"offload": {"what": ["params"], "when": "step"}},
                             "actor_train": {"offload": {"what": ["params", "optimizer"], "when": "iteration"}}},
    }))
    flow = compile_job(cfg, "checkpoint", "weights")
    assert flow.device_groups == {"forwards": ["ref_forward", "critic_forward", "reward_forward"],
                                  "trainers": ["actor_train", "critic_train"]}
    stages = flow.stages
    assert stages["ref_forward"].offload == OffloadPolicy(["params"], "step")  # its own
    assert stages["critic_forward"].offload == OffloadPolicy(["params"], "switch")  # a member's default
    assert stages["critic_train"].offload == OffloadPolicy(["params", "grads", "optimizer"], "switch")
    assert stages["actor_train"].offload == OffloadPolicy(["params", "optimizer"], "step")  # a trainer's iteration
    assert stages["reward_forward"].offload is None  # its rule reward holds nothing
    assert stages["rollout"].offload is None
    assert {s.lending for name, s in stages.items() if name in ("ref_forward", "actor_train")} == {None}
    processes = {r.name: r for r in JobPlan("g", flow).ranks()}
    assert "forwards-0" in processes and "trainers-0" in processes
    assert not {"ref_forward-0", "critic_forward-0", "actor_train-0", "critic_train-0"} & set(processes)
    hosts = {r["process"]: r.get("hosts") for r in JobPlan("g", flow).as_dict()["ranks"]}
    assert hosts["trainers-0"] == ["actor_train", "critic_train"] and hosts["rollout-0"] is None


def test_a_member_the_job_leaves_out_is_dropped_and_a_group_of_one_is_a_stage(tmp_path, caplog):
    """GRPO has no critic: a group of ref and critic forwards is the ref forward alone."""
    cfg = build(RLJobConfig, tiny_job(tmp_path, "g", **{
        "algorithm.advantage": "grpo", "rollout_batch.samples_per_prompt": 2,
        "placement.device_groups": FORWARDS}))
    flow = compile_job(cfg, "checkpoint", "weights")
    assert flow.device_groups == {}
    assert flow.stages["ref_forward"].offload is None
    assert "placement.device_groups.forwards: critic_forward not in this job" in caplog.text
