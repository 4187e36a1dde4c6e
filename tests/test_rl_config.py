"""RL job configs: bad keys, types and combinations fail before any process starts, naming the key."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from stream_rlhf.config import ConfigError, build, load_config
from stream_rlhf.driver.dataflow import compile_job
from stream_rlhf.rl.config import RLJobConfig
from tests.rl_tiny import VISION, tiny_job, write_job

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
ENV = {"factory": "stream_rlhf.envs.calculator:Calculator", "max_episode_tokens": 32}


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"rollout.top_p": 0}, "rollout.top_p=0.0: must be in (0, 1]"),
        ({"rollout.temprature": 1.0}, "rollout.temprature: unknown key"),
        ({"iterations": "many"}, "iterations='many': expected int"),
        ({"schedule": "sync", "overlap_depth": 1}, "overlap_depth=1: schedule=sync is on-policy"),
        ({"algorithm.advantage": "grpo"}, "rollout_batch.samples_per_prompt=1: algorithm.advantage=grpo needs >= 2"),
        ({"algorithm.advantage": "vtrace"}, "algorithm.advantage='vtrace': must be one of"),
        ({"model.tiny.head_dim": 16}, "model.tiny.head_dim=16: must be >= 32"),
        ({"model.tiny.hidden_size": -64}, "model.tiny.hidden_size=-64: must be >= 1"),
        ({"algorithm.clip_low": -0.2}, "algorithm.clip_low=-0.2: must be in [0, 1)"),
        ({"algorithm.kl.horizon": 0, "algorithm.kl.target": 0.1}, "algorithm.kl.horizon=0: must be >= 1"),
        ({"timeout_s": -5}, "timeout_s=-5.0: must be > 0"),
        ({"model.tiny.num_key_value_heads": 0}, "model.tiny.num_key_value_heads=0: must be >= 1"),
        ({"model.warm_start.batch_size": 0}, "model.warm_start.batch_size=0: must be >= 1"),
        ({"rollout.temperature": float("nan")}, "rollout.temperature=nan: must be a finite number"),
        ({"placement.stages": {"rollout": {"ranks": 2}}},
         "placement.stages.rollout.ranks=2: "
         "only ref_forward, actor_forward, critic_forward, actor_train, critic_train"),
        ({"placement.stages": {"trainer": {"ranks": 2}}}, "placement.stages.trainer: 'trainer' is not a stage"),
        ({"placement.stages": {"actor_train": {"ranks": 0}}}, "placement.stages.actor_train.ranks=0: must be >= 1"),
        ({"placement.stages": {"actor_train": {"ranks": 2, "devices": [0]}}},
         "placement.stages.actor_train.devices=[0]: one device per rank, ranks=2"),
        ({"placement.stages": {"actor_train": {"ranks": 2, "devices": [0, 0]}}},
         "placement.stages.actor_train.devices=[0, 0]: two ranks on one device"),
        ({"placement.stages": {"actor_train": {"ranks": 9}}},
         "placement.stages.actor_train.ranks=9: an optimizer step has as few as 8 samples"),
        ({"placement.device": "tpu"}, "placement.device='tpu': must be one of"),
        ({"algorithm.train_minibatches": 5, "placement.stages": {"actor_train": {"ranks": 5}}},
         "placement.stages.actor_train.ranks=5: an optimizer step has as few as 4 samples"),  # 16 in 4 parts of 4
        ({"actor.lr": float("inf")}, "actor.lr=inf: must be a finite number"),
        ({"actor.lr": -1e-3}, "actor.lr=-0.001: must be > 0"),
        ({"critic.max_grad_norm": 0}, "critic.max_grad_norm=0.0: must be > 0"),
        ({"model.path": "/nonexistent"}, "model.path='/nonexistent': no config.json there"),
        ({"reward.function": "no_colon"}, "reward.function='no_colon': expected 'package.module:name'"),
        ({"algorithm.kl.kind": "k4"}, "algorithm.kl.kind='k4': must be one of"),
        ({"restarts": {"actor_train": 1}}, "restarts.actor_train=1: only vision_prefetch, rollout, ref_forward"),
        ({"placement.offload": ["ref_forward"]}, "placement.offload: unknown key"),
        ({"task.name": "shapes"}, "task.name=shapes: asks about images, needs a vision-language model"),
        ({"data.train": "/nonexistent.jsonl", "data.eval": "/nonexistent.jsonl"},
         "data.train='/nonexistent.jsonl': no such file"),
        ({"data.eval": "eval.jsonl"}, "data.train=None, eval='eval.jsonl': give both or neither"),
        ({"data.on_bad_sample": "ignore"}, "data.on_bad_sample='ignore': must be one of"),
        ({"vision.prefetch_depth": 0}, "vision.prefetch_depth=0: must be >= 1"),
        ({"model.tiny.vision": {"embed_dim": 30, "num_heads": 4}}, "model.tiny.vision.num_heads=4: must divide"),
        ({"rollout.medusa.heads": 0}, "rollout.medusa.heads=0: must be >= 1"),
        ({"rollout.medusa.enabled": True, "task.name": "shapes", "model.tiny.vision": {}},
         "rollout.medusa.enabled=true: speculative rollout is text-only"),
        ({"rollout.backend": "vllm", "rollout.top_p": 0.9}, "rollout.top_p=0.9: backend=vllm needs top_p 1"),
        ({"rollout.backend": "vllm", "rollout.medusa.enabled": True},
         "rollout.medusa.enabled=true: Medusa speculative rollout is built on backend=torch"),
        ({"rollout.backend": "sglang"}, "rollout.backend='sglang': must be one of"),
        ({"rollout.decode": "graphs", "placement.device": "cpu"}, "rollout.decode=graphs: CUDA graphs need"),
        ({"rollout.decode": "compiled"}, "rollout.decode='compiled': must be one of"),
        ({"rollout.vllm.python": "/no/python"}, "rollout.vllm.python='/no/python': not an executable file"),
        ({"weights.update": "in_flight"}, "weights.update=in_flight: needs rollout.backend=vllm"),
        ({"weights.transport": "nccl"}, "weights.transport='nccl': must be one of"),
        ({"weights.bucket_mb": 0}, "weights.bucket_mb=0: must be >= 1"),
        ({"weights.transport": "cuda_ipc", "restarts": {"rollout": 1}},
         "restarts.rollout=1: a restarted instance cannot rejoin its weights.transport=cuda_ipc sender yet"),
        ({"reward.function": None}, "reward.function=None, reward.model_path=None: a reward function or a model_path "
                                    "is needed (or an env"),
        ({"env": ENV, "rollout.medusa.enabled": True},
         "rollout.medusa.enabled=true: speculative rollout is single-turn for now, env.factory="),
    ],
)
def test_bad_config_names_the_key(tmp_path, override, message):
    with pytest.raises(ConfigError) as err:
        build(RLJobConfig, tiny_job(tmp_path, "bad", **override))
    assert message in str(err.value)


def test_an_env_job_may_leave_the_reward_function_out(tmp_path):
    """Its episodes' turn rewards are the reward; the score is then 0."""
    cfg = build(RLJobConfig, tiny_job(tmp_path, "env", **{"env": ENV, "reward.function": None}))
    assert cfg.reward.function is None and cfg.env.factory == ENV["factory"]


def test_an_episode_must_fit_the_model_positions(tmp_path):
    too_long = r"env.max_episode_tokens=64: more than model.tiny.max_position_embeddings=32"
    with pytest.raises(ConfigError, match=too_long):
        build(RLJobConfig, tiny_job(tmp_path, "env", env={**ENV, "max_episode_tokens": 64}))
    vllm = {"rollout.backend": "vllm", "rollout.vllm.max_model_len": 48}
    with pytest.raises(ConfigError, match=r"env.max_episode_tokens=64: more than rollout.vllm.max_model_len=48"):
        build(RLJobConfig, tiny_job(tmp_path, "env", env={**ENV, "max_episode_tokens": 64}, **vllm))


@pytest.mark.slow
def test_cli_rejects_a_bad_config_before_starting_anything(tmp_path):
    path = write_job(tmp_path / "bad.yaml", tiny_job(tmp_path, "bad"))
    result = subprocess.run(
        [sys.executable, "-m", "stream_rlhf.cli", "run", str(path), "--set", "rollout_batch.minibatches=0"],
        capture_output=True, text=True, timeout=60, check=False,
    )
    assert result.returncode == 2
    assert "rollout_batch.minibatches=0: must be >= 1" in result.stderr
    assert not (tmp_path / "bad").exists()  # nothing ran: no run folder


@pytest.mark.slow
def test_cli_rejects_a_placement_this_machine_cannot_run_before_the_warm_start(tmp_path):
    path = write_job(tmp_path / "cores.yaml", tiny_job(tmp_path, "cores"))
    result = subprocess.run(
        [sys.executable, "-m", "stream_rlhf.cli", "run", str(path), "--set",
         "placement.stages={critic_train: {ranks: 2, cores: [0, 4096]}}"],
        capture_output=True, text=True, timeout=60, check=False,
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert "placement.stages.critic_train.cores=[0, 4096]: cores [4096] are not available" in result.stderr
    assert "warm start" not in result.stderr and not (tmp_path / "cores").exists()


def test_shipped_configs_load_and_compile():
    configs = (("text_ppo.yaml", True, False), ("text_grpo.yaml", False, False), ("mllm_ppo.yaml", True, True))
    for name, critic, vision in configs:
        cfg = load_config(RLJobConfig, CONFIGS / name)
        flow = compile_job(cfg, "checkpoint", "weights", vision_language=vision)
        assert ("critic_forward" in flow.stages) is critic
        assert ("vision_prefetch" in flow.stages) is vision
        assert flow.topology.topics["experience"].join[0] == "rollout"  # samples keep rollout's policy_version


def test_the_dataflow_leaves_out_the_forwards_a_config_never_uses(tmp_path):
    on_policy = {"overlap_depth": 0}
    no_kl = compile_job(build(RLJobConfig, tiny_job(tmp_path, "nokl", **on_policy, **{"algorithm.kl.coef": 0.0})),
                        "c", "w")
    assert "ref_forward" not in no_kl.stages and "actor_forward" in no_kl.stages  # two optimizer steps
    assert no_kl.topology.topics["experience"].join == ["rollout", "reward", "old_logp", "values"]
    assert no_kl.left_out == {"ref_forward": "algorithm.kl.coef=0 and fixed (no kl.target): no KL to compute"}
    one_step = build(RLJobConfig, tiny_job(tmp_path, "one", **on_policy, **{"algorithm.kl.coef": 0.0,
                                                                             "algorithm.train_minibatches": 1}))
    flow = compile_job(one_step, "c", "w")
    assert flow.topology.topics["experience"].join == ["rollout", "reward", "values"]
    assert set(flow.left_out) == {"ref_forward", "actor_forward"}
    adaptive = build(RLJobConfig, tiny_job(tmp_path, "a", **on_policy, **{
        "algorithm.kl.coef": 0.0, "algorithm.kl.target": 0.1}))
    assert compile_job(adaptive, "c", "w").left_out == {}  # the coefficient can grow: KL is needed
    with_kl = build(RLJobConfig, tiny_job(tmp_path, "kl1", **on_policy, **{"algorithm.train_minibatches": 1}))
    assert set(compile_job(with_kl, "c", "w").left_out) == {"actor_forward"}  # the KL is the sampler's
    grpo = build(RLJobConfig, tiny_job(tmp_path, "g", **on_policy, **{"algorithm.advantage": "grpo",
                                                                      "rollout_batch.samples_per_prompt": 2}))
    assert compile_job(grpo, "c", "w").left_out == {"critic_forward": "algorithm.advantage=grpo has no critic"}


def test_with_rollout_running_ahead_there_is_no_actor_forward_whose_log_probs_would_be_stale(tmp_path, caplog):
    """overlap_depth >= 1: the proximal policy is the one training starts from, which a forward
    before training cannot have; actor_train computes those log-probs (never both passes)."""
    cfg = build(RLJobConfig, tiny_job(tmp_path, "k1", overlap_depth=1,
                                      **{"placement.stages": {"actor_forward": {"ranks": 1}}}))
    with caplog.at_level(logging.INFO, logger="stream_rlhf.driver.dataflow"):
        flow = compile_job(cfg, "c", "w")
    assert "actor_forward" not in flow.stages and "ref_forward" in flow.stages  # the KL still needs the reference
    assert flow.topology.topics["experience"].join == ["rollout", "ref_logp", "reward", "values"]
    assert flow.left_out["actor_forward"].startswith("overlap_depth=1: rollout runs ahead of training")
    assert "placement.stages.actor_forward: not used, this config has no actor_forward stage" in caplog.text


def test_medusa_adds_its_trainer_beside_the_others(tmp_path):
    cfg = build(RLJobConfig, tiny_job(tmp_path, "m", **{"rollout.medusa.enabled": True}))
    topics = compile_job(cfg, "checkpoint", "weights").topology.topics
    assert topics["experience"].consumers == ["actor_train", "critic_train", "medusa_train"]
    assert topics["experience"].align_at_stop == ["actor_train", "critic_train"]  # the parts of a checkpoint
    stale = build(RLJobConfig, tiny_job(tmp_path, "m", **{"rollout.medusa.enabled": True,
                                                          "rollout.medusa.companion": False}))
    assert "medusa_train" not in compile_job(stale, "checkpoint", "weights").stages


def test_multimodal_dataflow_shares_one_features_handle(tmp_path):
    cfg = build(RLJobConfig, tiny_job(tmp_path, "mm", **VISION, **{"vision.prefetch_depth": 3}))
    topics = compile_job(cfg, "checkpoint", "weights", vision_language=True).topology.topics
    assert topics["vision"].consumers == ["rollout"] and topics["vision"].capacity == 3
    assert topics["generated"].join == ["rollout", "vision"]
    assert topics["experience"].join[:2] == ["rollout", "vision"]
    no_prefetch = build(RLJobConfig, tiny_job(tmp_path, "mm", **VISION, **{"vision.prefetch": False}))
    flow = compile_job(no_prefetch, "checkpoint", "weights", vision_language=True)
    assert "vision_prefetch" not in flow.stages and "vision" not in flow.topology.topics
    assert flow.topology.topics["generated"].join == ["rollout", "prompts"]  # pixels: each stage encodes


def test_sync_schedule_adds_barriers_and_room_for_an_iteration(tmp_path):
    cfg = build(RLJobConfig,
                tiny_job(tmp_path, "s", schedule="sync", overlap_depth=0, **{"rollout_batch.minibatches": 12}))
    flow = compile_job(cfg, "checkpoint", "weights")
    assert flow.admission.barrier_topics == {"rollout", "experience"}
    assert flow.broker.queue_capacity >= 12


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_cuda_ipc_without_a_gpu_is_refused_before_anything_starts(tmp_path):
    cfg = build(RLJobConfig, tiny_job(tmp_path, "ipc", **{"weights.transport": "cuda_ipc"}))
    with pytest.raises(ConfigError, match="weights.transport=cuda_ipc: needs a CUDA device"):
        compile_job(cfg, "ckpt", str(tmp_path / "w"))


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"placement.train_cores": [4096]}, "placement.train_cores=[4096]: cores [4096] are not available"),
        ({"placement.stages": {"actor_train": {"ranks": 2, "cores": [0, 4096]}}},
         "placement.stages.actor_train.cores=[0, 4096]: cores [4096] are not available"),
        ({"placement.stages": {"critic_train": {"ranks": 3, "cores": [0, 1]}}},
         "placement.stages.critic_train.ranks=3: more ranks than its cores [0, 1]"),
        ({"placement.device": "cpu", "placement.stages": {"actor_train": {"ranks": 2, "devices": [0, 1]}}},
         "placement.stages.actor_train.devices=[0, 1]: CUDA device indices, but this stage runs on the CPU"),
    ],
)
def test_bad_placement_fails_at_compile_naming_the_key(tmp_path, override, message):
    """Checks against this machine run when the job compiles, in the driver, before any process."""
    cfg = build(RLJobConfig, tiny_job(tmp_path, "bad", **override))
    with pytest.raises(ConfigError) as err:
        compile_job(cfg, "checkpoint", "weights")
    assert message in str(err.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_cuda_placement_without_a_gpu_is_refused_before_anything_starts(tmp_path):
    cfg = build(RLJobConfig, tiny_job(tmp_path, "cuda", **{"placement.device": "cuda"}))
    with pytest.raises(ConfigError, match="placement.device=cuda: this machine has no CUDA device"):
        compile_job(cfg, "checkpoint", "weights")


def test_ranks_share_out_their_stage_cores_and_get_devices(tmp_path):
    cfg = build(RLJobConfig, tiny_job(tmp_path, "g", **{
        "placement.device": "cpu",
        "placement.stages": {"actor_train": {"ranks": 2, "cores": [0, 1]}, "ref_forward": {"ranks": 1}},
    }))
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two cores (the placement names cores 0 and 1)")
    stages = compile_job(cfg, "checkpoint", "weights").stages
    actor = stages["actor_train"]
    assert (actor.ranks, actor.rank_cores, actor.threads, actor.devices) == (2, [[0], [1]], 1, ["cpu", "cpu"])
    assert stages["critic_train"].ranks == 1 and stages["critic_train"].devices == ["cpu"]


def test_with_rollout_puts_stages_on_the_rollout_cores_and_lends_them_as_that_side(tmp_path, caplog):
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two cores (the placement names cores 0 and 1)")
    cfg = build(RLJobConfig, tiny_job(tmp_path, "w", **{
        "placement.device": "cpu", "placement.mode": "separated", "placement.rollout_cores": [0],
        "placement.train_cores": [1], "placement.with_rollout": ["critic_forward", "critic_train"]}))
    stages = compile_job(cfg, "checkpoint", "weights").stages
    cores = {name: spec.rank_cores for name, spec in stages.items()}
    assert cores["rollout"] == cores["critic_forward"] == cores["critic_train"] == [[0]]
    assert cores["actor_train"] == cores["ref_forward"] == [[1]]
    assert stages["critic_train"].lending.lender_cores == (1,)  # it borrows the train side's core
    assert stages["actor_train"].lending.lender_cores == (0,)
    grpo = build(RLJobConfig, tiny_job(tmp_path, "w", **{
        "placement.mode": "separated", "placement.with_rollout": ["critic_train"], "algorithm.advantage": "grpo",
        "rollout_batch.samples_per_prompt": 2}))
    with caplog.at_level(logging.INFO):
        compile_job(grpo, "checkpoint", "weights")  # the shipped PPO configs name it: GRPO from them still runs
    assert "placement.with_rollout: critic_train not in this job" in caplog.text
    with pytest.raises(ConfigError, match=r"placement.with_rollout: 'rollout' is not a stage that could leave"):
        build(RLJobConfig, tiny_job(tmp_path, "w", **{"placement.with_rollout": ["rollout"]}))


def test_stateless_stages_restart_by_default_and_rollout_only_where_it_can_rejoin():
    shm = build(RLJobConfig, {"name": "r"})
    assert {s: shm.restarts_of(s) for s in ("rollout", "ref_forward", "actor_train", "prompts")} == {
        "rollout": 2, "ref_forward": 2, "actor_train": 0, "prompts": 0}
    broadcast = build(RLJobConfig, {"name": "r", "weights": {"transport": "broadcast"}})
    assert broadcast.restarts_of("rollout") == 2 and broadcast.restarts_of("critic_forward") == 2
    cuda_ipc = build(RLJobConfig, {"name": "r", "weights": {"transport": "cuda_ipc"}})
    assert cuda_ipc.restarts_of("rollout") == 0
    assert build(RLJobConfig, {"name": "r", "restarts": {"rollout": 0}}).restarts_of("rollout") == 0
    with pytest.raises(ConfigError, match="checkpoint.recoveries=-1"):
        build(RLJobConfig, {"name": "r", "checkpoint": {"recoveries": -1}})
