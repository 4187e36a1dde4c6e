"""Device groups of several ranks: two forwards of two data-parallel ranks each in one group, and
the two trainers of two FSDP2 ranks each in another, run as two processes per group, rank r of
every member in process r, taking turns in rank 0's order on every rank (`weights/turn_order.py`),
and give, sample by sample, the same log-probs, values, rewards and advantages, and the same
trained policy, as the four as separate two-rank stages. Sync schedule, so both runs are
deterministic; real broker and processes (gloo on the CPU)."""

from __future__ import annotations

import json
import os
import re

import pytest

from stream_rlhf.telemetry.metrics import read_metrics
from tests.rl_tiny import tiny_job
from tests.test_rank_groups import kill_a_follower_and_finish
from tests.test_rl_device_groups import assert_same_samples
from tests.test_rl_job import leftover_shm, start_run
from tests.test_rl_process_rewards import run

pytestmark = pytest.mark.slow
RANKS = {stage: {"ranks": 2} for stage in ("ref_forward", "critic_forward", "actor_train", "critic_train")}
GROUPS = {"forwards": ["ref_forward", "critic_forward"], "trainers": ["actor_train", "critic_train"]}


@pytest.fixture(autouse=True)
def _two_cores():
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("a group of two ranks needs two cores (one each)")


def job(tmp_path, name: str, **overrides: object) -> dict:
    return tiny_job(tmp_path, name, schedule="sync", overlap_depth=0, iterations=2, broker={"shm_prefix": f"t_{name}"},
                    samples_log={"per_minibatch": 8}, **{"placement.stages": RANKS}, **overrides)


@pytest.mark.timeout(600)
def test_groups_of_two_rank_members_give_the_samples_of_separate_stages(tmp_path):
    separate, separate_dir = run(tmp_path, job(tmp_path, "separate"))
    grouped, grouped_dir = run(tmp_path, job(tmp_path, "grouped", **{"placement.device_groups": GROUPS}))

    assert grouped["samples_trained"] == separate["samples_trained"] == 32
    assert grouped["memory"]["processes"] == separate["memory"]["processes"] - 4  # 8 processes -> 4
    processes = {f"{group}-0{rank}" for group in GROUPS for rank in ("", ".rank1")}
    assert processes <= set(grouped["memory"]["per_process"])
    log = (tmp_path / "grouped.log").read_text()
    assert "forwards-0.rank1: ref_forward, critic_forward in one process on cpu (rank 1 of 2 of each)" in log
    assert "trainers-0.rank1: actor_train, critic_train in one process on cpu (rank 1 of 2 of each)" in log
    for stage in RANKS:  # rank 1 of each member followed its leader
        assert re.search(rf"{stage}-0 rank 1 of 2 \(pid \d+\) follows its leader on cpu", log), stage
    assert_same_samples(separate_dir, grouped_dir)
    trained = {name: read_metrics(folder / "metrics.jsonl") for name, folder in (("separate", separate_dir),
                                                                                ("grouped", grouped_dir))}
    assert [r["iteration"] for r in trained["grouped"]] == [0, 1]
    for ours, theirs in zip(trained["grouped"], trained["separate"], strict=True):
        for key in ("loss", "grad_norm", "approx_kl", "entropy"):
            assert ours[key] == pytest.approx(theirs[key], abs=1e-4), key
    for key in ("eval_reward_after", "eval_greedy_reward_after"):  # the same trained policy
        assert grouped[key] == separate[key]


def test_a_group_of_two_rank_members_restarts_every_rank_and_the_run_completes(tmp_path):
    """A follower process of the group killed: both processes (every rank of both members) start
    again on a new rendezvous, and every sample is trained."""
    iterations = 12
    process, log = start_run(tmp_path, "regroup", f"iterations={iterations}",
                             "restarts={ref_forward: 1, critic_forward: 1}",
                             "placement.stages={ref_forward: {ranks: 2}, critic_forward: {ranks: 2}}",
                             "placement.device_groups={forwards: [ref_forward, critic_forward]}")
    text = kill_a_follower_and_finish(process, log, tmp_path / "regroup")
    assert re.search(r"forwards-0 \(ref_forward, critic_forward\) exited \(.*forwards-0\.rank1 -9.*\): restarting it "
                     r"\(0 restart\(s\) left\)", text), text[-3000:]
    assert len(re.findall(r"critic_forward-0 rank 1 of 2 \(pid \d+\)", text)) == 2  # a new group
    summary = json.loads((tmp_path / "regroup" / "summary.json").read_text())
    assert summary["iterations"] == iterations and summary["samples_trained"] == iterations * 2 * 8
    assert not leftover_shm("t_regroup")
