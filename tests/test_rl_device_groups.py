"""`stream-rlhf run` with device groups: the four forwards in two groups (seed 004's actor -> ref,
critic -> reward) and the two trainers in a third give, sample by sample, the same rewards,
log-probs, advantages and KL as one process per stage, and learn the same. Sync schedule, so both
runs are deterministic; real broker and processes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.rl_tiny import tiny_job
from tests.test_rl_process_rewards import run

pytestmark = pytest.mark.slow
GROUPS = {"policies": ["actor_forward", "ref_forward"], "scores": ["critic_forward", "reward_forward"],
          "trainers": ["actor_train", "critic_train"]}


def job(tmp_path: Path, name: str, **overrides: object) -> dict:
    return tiny_job(tmp_path, name, schedule="sync", overlap_depth=0, iterations=2, broker={"shm_prefix": f"t_{name}"},
                    samples_log={"per_minibatch": 8}, **overrides)


def assert_same_samples(separate_dir: Path, grouped_dir: Path) -> None:
    """The two runs logged the same 32 samples (2 iterations of the tiny job), field by field."""
    samples = {name: [json.loads(line) for line in (folder / "samples.jsonl").read_text().splitlines()]
               for name, folder in (("separate", separate_dir), ("grouped", grouped_dir))}
    assert len(samples["grouped"]) == len(samples["separate"]) == 32
    for ours, theirs in zip(samples["grouped"], samples["separate"], strict=True):
        for key in ("iteration", "minibatch", "response", "reward", "logprob", "advantage", "kl"):
            assert ours[key] == theirs[key], (key, ours, theirs)


@pytest.mark.timeout(600)
def test_four_forwards_in_two_device_groups_give_the_same_samples_as_four_stages(tmp_path):
    separate, separate_dir = run(tmp_path, job(tmp_path, "separate"))
    grouped, grouped_dir = run(tmp_path, job(tmp_path, "grouped", **{
        "placement.device_groups": GROUPS,
        "placement.stages": {"ref_forward": {"offload": {"what": ["params"], "when": "step"}}}}))

    assert grouped["samples_trained"] == separate["samples_trained"] == 32
    assert grouped["memory"]["processes"] == separate["memory"]["processes"] - 3  # 7 stage processes -> 4
    assert set(grouped["memory"]["per_process"]) >= {"policies-0", "scores-0", "trainers-0"}
    assert separate["offload"] is None
    moved = grouped["offload"]["ref_forward"]  # after its setup and each of its 4 steps; back for each step
    assert (moved["policy"], moved["offloads"], moved["onloads"]) == ("params when step", 5, 4)
    assert set(grouped["offload"]) == {"ref_forward", "actor_forward", "critic_forward", "actor_train", "critic_train"}
    assert_same_samples(separate_dir, grouped_dir)  # every sample of both iterations
    for key in ("eval_reward_after", "eval_greedy_reward_after"):
        assert grouped[key] == separate[key]


@pytest.mark.timeout(900)
def test_megatron_stages_in_device_groups_give_the_same_samples_as_megatron_stages_apart(tmp_path):
    """Two megatron members in one process share its megatron parallel state (one rank, tp 1)."""
    pytest.importorskip("megatron.core", reason="the megatron extra (pip install -e '.[megatron]') runs this")
    on_megatron = {stage: {"backend": "megatron"} for stage in
                   ("actor_forward", "ref_forward", "critic_forward", "actor_train", "critic_train")}
    separate, separate_dir = run(tmp_path, job(tmp_path, "mseparate", **{"placement.stages": on_megatron}))
    grouped, grouped_dir = run(tmp_path, job(tmp_path, "mgrouped", **{
        "placement.device_groups": GROUPS,
        "placement.stages": on_megatron | {"ref_forward": {"backend": "megatron",
                                                          "offload": {"what": ["params"], "when": "step"}}}}))

    assert grouped["samples_trained"] == separate["samples_trained"] == 32
    assert grouped["memory"]["processes"] == separate["memory"]["processes"] - 3
    assert_same_samples(separate_dir, grouped_dir)
    assert grouped["eval_reward_after"] == separate["eval_reward_after"]
