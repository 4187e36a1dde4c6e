"""The bad-config table: `stream-rlhf run` on a bad config exits 2 before any stage process
starts, with one line naming the key, file or line (no traceback).

Each row runs the real CLI entry point in-process on a tiny RL job (or the broker demo) plus
`--set` overrides; a stage process would have written into the run folder, so it must be
absent or empty. The one-core placement test runs the config checks in a process pinned to one
core.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from PIL import Image

from stream_rlhf import cli
from stream_rlhf.launch.placement import split_cores
from stream_rlhf.models.tokenizer import build_tokenizer
from tests.rl_tiny import VISION, tiny_job, write_job
from tests.tiny_models import seeded_qwen2_policy

ROOT = Path(__file__).resolve().parent.parent
DEMO = str(ROOT / "configs" / "broker_demo.yaml")
GRPO = ("algorithm.advantage=grpo", "rollout_batch.samples_per_prompt=2")

# (overrides, words of the message); the job is tests/rl_tiny.py's, {tmp} is the test's folder
RL_ROWS = [
    # keys the chosen algorithm ignores
    ((*GRPO, "critic.lr=5e-4"), "critic.lr=0.0005: algorithm.advantage=grpo has no critic"),
    ((*GRPO, "algorithm.value_clip=0.3"), "algorithm.value_clip=0.3: algorithm.advantage=grpo ignores it"),
    ((*GRPO, "algorithm.lam=0.9"), "algorithm.lam=0.9: algorithm.advantage=grpo ignores it"),
    (("algorithm.advantage=reinforce_pp", "algorithm.lam=0.5"),
     "algorithm.lam=0.5: algorithm.advantage=reinforce_pp ignores it"),
    (("algorithm.group_std=false",), "algorithm.group_std=False: algorithm.advantage=gae ignores it"),
    (("algorithm.loss_aggregation=seq_mean",), "algorithm.loss_aggregation='seq_mean': must be one of"),
    (("algorithm.ratio_level=sample",), "algorithm.ratio_level='sample': must be one of 'token', 'sequence'"),
    (("algorithm.sampler_correction=true", "overlap_depth=1"),
     "algorithm.sampler_correction=true: overlap_depth=1 weights every token by proximal / behaviour already"),
    (("algorithm.advantage=rloo", "rollout_batch.samples_per_prompt=2", "placement.stages={critic_train: {}}"),
     "placement.stages.critic_train: algorithm.advantage=rloo has no critic"),
    # prompt + response within the model's positions (the longest prompt: a bos and "ab+cd=")
    (("model.tiny.max_position_embeddings=10",), "rollout.max_new_tokens=4 after the longest prompt (7 tokens, "),
    (("rollout.max_new_tokens=40",),
     "of task.max_operand=99) needs 47 positions, more than model.tiny.max_position_embeddings=32"),
    # reward.function names itself
    (("reward.function=stream_rlhf.data.arithmetic:nope",),
     "reward.function='stream_rlhf.data.arithmetic:nope': module stream_rlhf.data.arithmetic has no nope"),
    (("reward.function=no_such_module:reward",), "reward.function='no_such_module:reward': module no_such_module "
                                                  "does not import"),
    (("reward.function=stream_rlhf.data.arithmetic:EVAL_EVERY",),
     "reward.function='stream_rlhf.data.arithmetic:EVAL_EVERY': not callable"),
    # the observation cut's marker in the policy's tokens
    (("env={factory: stream_rlhf.envs.calculator:Calculator, max_episode_tokens: 32, max_observation_tokens: 2}",
      "reward.function=null"),
     "env.observation_cut_marker=' ...' is 4 tokens, which leaves nothing of env.max_observation_tokens=2"),
    (("env={factory: stream_rlhf.envs.calculator:Calculator, max_episode_tokens: 32, stop_strings: ['a', '']}",
      "reward.function=null"), "env.stop_strings[1]='': a stop string must not be empty"),
    # numbers: NaN, inf and out of range
    (("broker.heartbeat_interval_s=.nan",), "broker.heartbeat_interval_s=nan: must be a finite number"),
    (("actor.lr=.inf",), "actor.lr=inf: must be a finite number"),
    (("critic.weight_decay=-1",), "critic.weight_decay=-1.0: must be >= 0"),
    (("model.tiny.hidden_size=-64",), "model.tiny.hidden_size=-64: must be >= 1"),
    (("rollout.temperature=.nan",), "rollout.temperature=nan: must be a finite number"),
    (("rollout.top_p=1.5",), "rollout.top_p=1.5: must be in (0, 1]"),
    (("algorithm.clip_low=1.5",), "algorithm.clip_low=1.5: must be in [0, 1)"),
    (("algorithm.gamma=-.inf",), "algorithm.gamma=-inf: must be a finite number"),
    (("algorithm.kl.coef=-0.1",), "algorithm.kl.coef=-0.1: must be >= 0"),
    (("weights.timeout_s=0",), "weights.timeout_s=0.0: must be > 0"),
    (("timeout_s=-5",), "timeout_s=-5.0: must be > 0"),
    (("model.warm_start.lr=0",), "model.warm_start.lr=0.0: must be > 0"),
    (("task.max_operand=0",), "task.max_operand=0: must be >= 1"),
    (("data.max_pixels=1", "data.min_pixels=4"), "data.min_pixels=4, max_pixels=1: need 1 <= min <= max"),
    (("broker.queue_capacity=0",), "broker.queue_capacity=0: must be >= 1"),
    (("precision=fp16",), "precision='fp16': must be one of 'auto', 'fp32', 'bf16'"),
    # LoRA: the torch engine's, on layers the model has
    (("actor.lora={rank: 4}", "placement.stages={actor_train: {backend: megatron}}"),
     "actor.lora: built for the torch backend, and placement.stages.actor_train.backend=megatron"),
    (("actor.gradient_checkpointing=true", "placement.stages={actor_train: {backend: megatron}}"),
     "actor.gradient_checkpointing: the torch backend's switch; placement.stages.actor_train.backend=megatron "
     "recomputes with placement.stages.actor_train.megatron.recompute: true"),
    (("critic.micro_batch_tokens=0",), "critic.micro_batch_tokens=0: must be >= 1"),
    # the LoRA base as the reference: under actor.lora, with a KL, without a critic
    (("algorithm.kl.reference=lora_base",), "algorithm.kl.reference=lora_base: the actor's model is the starting "
                                           "checkpoint with its adapters off only under actor.lora"),
    ((*GRPO, "actor.lora={rank: 4}", "algorithm.kl={reference: lora_base, coef: 0}"),
     "algorithm.kl.reference=lora_base: algorithm.kl.coef=0 and fixed: there is no KL"),
    (("actor.lora={rank: 4}", "algorithm.kl.reference=lora_base"),
     "algorithm.kl.reference=lora_base: critic_train also reads the reference log-probs"),
    ((*GRPO, "algorithm.kl.reference=stage"), "algorithm.kl.reference='stage': must be one of 'ref_forward', "),
    # dynamic sampling: among groups of group-relative advantages, at most an iteration's groups
    (("algorithm.dynamic_sampling={}",), "algorithm.dynamic_sampling: leaves out groups whose advantages are all "
                                         "zero, which needs a group-relative advantage (grpo, rloo), not gae"),
    ((*GRPO, "algorithm.dynamic_sampling={groups: 17}"),
     "algorithm.dynamic_sampling.groups=17: more than the 16 groups an iteration generates"),
    ((*GRPO, "algorithm.dynamic_sampling={groups: 0}"), "algorithm.dynamic_sampling.groups=0: must be >= 1"),
    ((*GRPO, "algorithm.dynamic_sampling={}", "reward.process={function: stream_rlhf.data.arithmetic:step_reward}"),
     "algorithm.dynamic_sampling: with reward.process the samples of a group of equal returns still differ"),
    (("actor.lora={target_modules: [q_proj, qkv]}",),
     "actor.lora.target_modules: ['qkv'] name no linear layer of the embedded model's decoder layers (q_proj, "),
    (("actor.lora={rank: 0}",), "actor.lora.rank=0: must be >= 1"),
    (("placement.stages={critic_train: {backend: megatron}}", "critic.lora={rank: 4}"),
     "critic.lora: built for the torch backend, and placement.stages.critic_train.backend=megatron"),
    ((*GRPO, "critic.lora={rank: 4}"), "critic.lora=LoRAConfig(rank=4, alpha=16.0, target_modules=['q_proj', "),
    (("actor.lora={target_modules: []}",), "actor.lora.target_modules=[]: name at least one linear layer"),
    (("placement.rollout_cores=[-1]",), "placement.rollout_cores=[-1]: core numbers are >= 0"),
    (("placement.stages={actor_train: {devices: [-1]}}",), "placement.stages.actor_train.devices=[-1]: device "
                                                           "indices are >= 0"),
    # placement against this machine
    (("placement.train_cores=[4096]",), "placement.train_cores=[4096]: cores [4096] are not available to this "
                                        "process (it may run on cores ["),
    # YAML inside --set
    (("rollout.max_new_tokens=[4",), "--set rollout.max_new_tokens: the value '[4' is not valid YAML"),
    (("placement.stages={actor_train: {devices: [0]}, actor_train: {}}",),
     "--set placement.stages={actor_train: {devices: [0]}, actor_train: {}}: key 'actor_train' given twice in "
     "the value"),
]


def _run(argv: list[str], capsys) -> tuple[int, str]:
    code = cli.main(argv)
    return code, capsys.readouterr().err


def _assert_nothing_started(run_dir: Path) -> None:
    """Every stage process writes into the run folder (counts, metrics, logs); the driver may have
    made it, empty, before the data checks."""
    assert not run_dir.exists() or not any(run_dir.iterdir()), sorted(p.name for p in run_dir.iterdir())


@pytest.mark.parametrize(("overrides", "words"), RL_ROWS, ids=[row[0][-1] for row in RL_ROWS])
def test_a_bad_rl_config_exits_2_naming_the_key(tmp_path, capsys, overrides, words):
    path = write_job(tmp_path / "job.yaml", tiny_job(tmp_path, "bad"))
    code, err = _run(["run", str(path), *(f"--set={o}" for o in overrides)], capsys)
    assert code == 2, err[-2000:]
    assert words in err and err.startswith("config error: ")
    assert "Traceback" not in err
    _assert_nothing_started(tmp_path / "bad")


def _text_data(folder: Path, lines: list[str]) -> list[str]:
    (folder / "train.jsonl").write_text("\n".join(lines) + "\n")
    (folder / "eval.jsonl").write_text('{"prompt": "1+2=", "answer": "3"}\n')
    return [f"data.train={folder / 'train.jsonl'}", f"data.eval={folder / 'eval.jsonl'}"]


def _image_data(folder: Path, images: list[str]) -> list[str]:
    (folder / "images").mkdir()
    Image.new("RGB", (32, 32)).save(folder / "images" / "1.png")
    lines = [json.dumps({"prompt": "<image>how many?", "images": [name], "answer": "1"}) for name in images]
    (folder / "train.jsonl").write_text("\n".join(lines) + "\n")
    (folder / "eval.jsonl").write_text(lines[0] + "\n")
    return [f"data.train={folder / 'train.jsonl'}", f"data.eval={folder / 'eval.jsonl'}"]


def test_lora_targets_a_checkpoint_folder_lacks_are_named_before_the_warm_start(tmp_path, capsys):
    folder = tmp_path / "checkpoint"
    seeded_qwen2_policy(40).save_pretrained(folder)
    build_tokenizer().save_pretrained(folder)
    path = write_job(tmp_path / "job.yaml", tiny_job(tmp_path, "bad"))
    code, err = _run(["run", str(path), f"--set=model.path={folder}", "--set=actor.lora={target_modules: [c_attn]}"],
                     capsys)
    assert code == 2, err[-2000:]
    assert (f"actor.lora.target_modules: ['c_attn'] name no linear layer of the decoder layers of "
            f"model.path='{folder}' (they have ['down_proj', 'gate_proj', 'input_layernorm', 'k_proj', ") in err
    _assert_nothing_started(tmp_path / "bad")


def test_a_bad_json_line_of_the_training_file_is_named_before_the_warm_start(tmp_path, capsys):
    data = _text_data(tmp_path, ['{"prompt": "1+2=", "answer": "3"}', '{"prompt": "2+2=", "answer": '])
    path = write_job(tmp_path / "job.yaml", tiny_job(tmp_path, "bad"))
    code, err = _run(["run", str(path), f"--set=model.warm_start.cache_dir={tmp_path / 'cache'}",
                      *(f"--set={o}" for o in data)], capsys)
    assert code == 2 and f"data error: {tmp_path / 'train.jsonl'}:2: not valid JSON" in err, err[-2000:]
    assert not (tmp_path / "cache").exists()  # no warm start began
    _assert_nothing_started(tmp_path / "bad")


def test_a_missing_training_image_is_named_before_the_warm_start(tmp_path, capsys):
    data = _image_data(tmp_path, ["images/1.png", "images/1.png", "images/gone.png"])
    path = write_job(tmp_path / "job.yaml", tiny_job(tmp_path, "bad", **VISION))
    code, err = _run(["run", str(path), f"--set=model.warm_start.cache_dir={tmp_path / 'cache'}",
                      "--set=model.warm_start.steps=0", *(f"--set={o}" for o in data)], capsys)  # samples no line
    assert code == 2, err[-2000:]
    assert f"data error: {tmp_path / 'train.jsonl'}:3: image images/gone.png: file not found" in err
    assert not (tmp_path / "cache").exists()  # no warm start began
    _assert_nothing_started(tmp_path / "bad")


def test_prompt_positions_count_the_image_tokens(tmp_path, capsys):
    """bos + vision_start + 4 image tokens + vision_end + "how many?" = 16, + 4 response tokens."""
    data = _image_data(tmp_path, ["images/1.png"])
    path = write_job(tmp_path / "job.yaml", tiny_job(tmp_path, "bad", **VISION))
    code, err = _run(["run", str(path), "--set=model.tiny.max_position_embeddings=19", *(f"--set={o}" for o in data)],
                     capsys)
    assert code == 2, err[-2000:]
    assert (f"rollout.max_new_tokens=4 after the longest prompt (16 tokens, {tmp_path / 'train.jsonl'}:1) needs 20 "
            "positions, more than model.tiny.max_position_embeddings=19") in err


DEMO_ROWS = [
    ("stages.trainer.cls=stream_rlhf.demo.stages:Trainer",
     "stages.trainer.cls='stream_rlhf.demo.stages:Trainer': module stream_rlhf.demo.stages has no Trainer"),
    ("stages.trainer.cls=stream_rlhf.demo.stagez:ToyTrainer",
     "stages.trainer.cls='stream_rlhf.demo.stagez:ToyTrainer': module stream_rlhf.demo.stagez does not import"),
    ("stages.trainer.cls=stream_rlhf.demo.stages:Path", "stages.trainer.cls='stream_rlhf.demo.stages:Path': not a "
                                                         "Stage class"),
    ("stages.rollout.kwargs.response_length=3",
     "stages.rollout.kwargs.response_length: stream_rlhf.demo.stages:ToyRollout takes no such argument"),
    ("stages.rollout.kwargs={step_ms: 3}", "stages.rollout.kwargs: stream_rlhf.demo.stages:ToyRollout needs "
                                           "response_len"),
    ("broker.heartbeat_interval_s=.nan", "broker.heartbeat_interval_s=nan: must be a finite number"),
    ("timeout_s=0", "timeout_s=0.0: must be > 0"),
]


@pytest.mark.parametrize(("override", "words"), DEMO_ROWS, ids=[row[0].split("=")[0] for row in DEMO_ROWS])
def test_a_bad_dataflow_config_exits_2_naming_the_stage_key(tmp_path, capsys, override, words):
    run_dir = tmp_path / "run"
    code, err = _run(["run", DEMO, f"--set=stages.trainer.kwargs.run_dir={run_dir}",
                      f"--set=broker.journal={tmp_path / 'journal'}", f"--set={override}"], capsys)
    assert code == 2 and words in err and "Traceback" not in err, err[-2000:]
    assert not run_dir.exists() and not (tmp_path / "journal").exists()


def test_a_yaml_syntax_error_names_the_file_and_line(tmp_path, capsys):
    path = tmp_path / "job.yaml"
    path.write_text("name: bad\nrollout:\n  temperature: 1.0\n   top_p: 0.9\n")
    code, err = _run(["run", str(path)], capsys)
    assert code == 2 and f"config error: {path}:4:" in err and "not valid YAML" in err, err
    path.write_text("name: bad\nalgorithm: {advantage: gae\n")
    code, err = _run(["run", str(path)], capsys)
    assert code == 2 and f"config error: {path}:3:" in err, err


def test_a_key_given_twice_names_the_key_and_both_lines(tmp_path, capsys):
    """PyYAML alone keeps the last value: the run would do what the user did not read."""
    path = tmp_path / "job.yaml"
    path.write_text("name: bad\niterations: 1\nrollout:\n  temperature: 1.0\n  top_p: 0.9\n  temperature: 0.5\n")
    code, err = _run(["run", str(path)], capsys)
    assert code == 2, err
    assert err == (f"config error: {path}:6: key 'temperature' given twice in one mapping (first at {path}:4); "
                   "remove one of them\n")
    path.write_text("name: bad\niterations: 1\nbase: &base {top_p: 0.9}\nrollout:\n  <<: *base\n  top_p: 0.5\n"
                    "iterations: 2\n")  # a merge key may be overridden: the top level's twice is the error
    code, err = _run(["plan", str(path)], capsys)
    assert code == 2 and f"{path}:7: key 'iterations' given twice in one mapping (first at {path}:2)" in err, err


def test_default_cores_follow_the_machine():
    assert split_cores([0], None, None) == ([0], [0])
    assert split_cores([0, 1], None, None) == ([0], [1])
    assert split_cores([2, 3, 5, 7], None, None) == ([2, 3], [5, 7])
    assert split_cores([0, 1, 2], [1], None) == ([1], [0, 2])
    assert split_cores([0], None, [0]) == ([0], [0])
    assert split_cores([0, 1], [0], [0]) == ([0], [0])


ONE_CORE = textwrap.dedent("""
    import os, sys
    core = min(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {core})
    from stream_rlhf.config import ConfigError, load_config
    from stream_rlhf.rl.config import RLJobConfig
    from stream_rlhf.driver.dataflow import compile_job
    for name, vision in (("mllm_ppo", True), ("text_ppo", False), ("text_grpo", False)):
        cfg = load_config(RLJobConfig, f"configs/{name}.yaml")
        flow = compile_job(cfg, "checkpoint", "weights", vision_language=vision)
        cores = {core for spec in flow.stages.values() for core in spec.cores}
        print(name, sorted(cores), cfg.placement.rollout_cores, cfg.placement.train_cores)
    try:
        compile_job(load_config(RLJobConfig, "configs/text_ppo.yaml", [f"placement.train_cores=[{core + 1}]"]),
                    "checkpoint", "weights")
    except ConfigError as error:
        print("error:", error)
""")


@pytest.mark.slow
def test_shipped_configs_place_on_a_one_core_machine():
    """The README's first command on a machine (or cgroup) with one core: every stage on that core."""
    result = subprocess.run([sys.executable, "-c", ONE_CORE], capture_output=True, text=True, timeout=120,
                            cwd=ROOT, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""}, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    core = min(os.sched_getaffinity(0))
    lines = result.stdout.splitlines()
    for name, line in zip(("mllm_ppo", "text_ppo", "text_grpo"), lines):
        assert line == f"{name} [{core}] [{core}] [{core}]"
    assert lines[3] == (f"error: placement.train_cores=[{core + 1}]: cores [{core + 1}] are not available to this "
                        f"process (it may run on cores [{core}]; leave the key out to use them)")
