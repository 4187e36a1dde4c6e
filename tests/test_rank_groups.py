"""Stage instances of several ranks in a whole job: results, accounting, a rank that dies."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from stream_rlhf.config import build
from stream_rlhf.driver.warm_start import warm_start
from stream_rlhf.rl.config import RLJobConfig
from stream_rlhf.rl.task_data import resolve_data
from stream_rlhf.telemetry.metrics import read_metrics
from tests.rl_tiny import VISION, tiny_job, write_job
from tests.test_rl_job import _gone_or_zombie, leftover_shm, start_run, wait_for_iterations

pytestmark = pytest.mark.slow
GROUPS = "placement.stages={actor_train: {ranks: 2}, critic_train: {ranks: 2}, ref_forward: {ranks: 2}}"
"""Colocated on both cores (tests/rl_tiny.py): each rank of a group gets one."""


@pytest.fixture(autouse=True)
def _two_cores():
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("a group of two ranks needs two cores (one each)")


def test_two_rank_actor_stages_train_as_one_rank_does(tmp_path):
    """GRPO (no critic: which critic version a forward sees depends on timing), sync schedule,
    on-policy: both runs sample the same tokens from the same weights, so the 2-rank FSDP2 trainer
    and the 2-rank forwards must give the metrics of the 1-rank run."""
    grpo = ("algorithm.advantage=grpo", "rollout_batch.samples_per_prompt=2", "schedule=sync", "overlap_depth=0",
            "iterations=3")
    one, one_log = start_run(tmp_path, "one", *grpo)
    assert one.wait(timeout=300) == 0, one_log.read_text()[-3000:]
    two, two_log = start_run(tmp_path, "two", *grpo, "placement.stages={actor_train: {ranks: 2}, "
                             "actor_forward: {ranks: 2}, ref_forward: {ranks: 2}}")
    assert two.wait(timeout=300) == 0, two_log.read_text()[-3000:]
    text = two_log.read_text()
    for stage in ("actor_train", "actor_forward", "ref_forward"):
        assert re.search(rf"{stage}-0 rank 1 of 2 \(pid \d+\) follows its leader on cpu", text), stage
    records = {name: read_metrics(tmp_path / name / "metrics.jsonl") for name in ("one", "two")}
    assert [r["iteration"] for r in records["two"]] == [0, 1, 2]
    for a, b in zip(records["one"], records["two"]):
        assert b["reward"] == a["reward"] and b["response_len"] == a["response_len"]
        for key in ("loss", "kl", "approx_kl", "entropy", "grad_norm", "ratio_max"):
            assert b[key] == pytest.approx(a[key], abs=1e-4), key
    summaries = {name: json.loads((tmp_path / name / "summary.json").read_text()) for name in ("one", "two")}
    assert summaries["two"]["eval_reward_after"] == summaries["one"]["eval_reward_after"]
    assert (tmp_path / "two" / "checkpoint" / "model.safetensors").is_file()
    assert not leftover_shm("t_two")
    # rank 1 traces its fetch and its share of every step on its own track
    events = json.loads((tmp_path / "two" / "trace.json").read_text())["traceEvents"]
    processes = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    tracks = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["name"] == "thread_name"}
    traced: dict[tuple[str, str], set] = {}
    for e in events:
        if e["ph"] == "X" and processes[e["pid"]] == "actor_train-0" and e["cat"] in ("step", "payload"):
            traced.setdefault((tracks[(e["pid"], e["tid"])], e["name"]), set()).add(e["args"].get("iteration"))
    assert traced[("rank 1", "actor_train experience")] == traced[("rank 0", "actor_train experience")] == {0, 1, 2}
    assert ("rank 1", "fetch") in traced


def test_ppo_with_two_rank_trainers_accounts_for_every_sample(tmp_path):
    process, log = start_run(tmp_path, "groups", "iterations=3", GROUPS)
    assert process.wait(timeout=300) == 0, log.read_text()[-3000:]
    text = log.read_text()
    for stage in ("actor_train", "critic_train", "ref_forward"):
        assert re.search(rf"{stage}-0 rank 1 of 2 \(pid \d+\) follows its leader on cpu", text), stage
    summary = json.loads((tmp_path / "groups" / "summary.json").read_text())
    assert summary["samples_trained"] == summary["samples_generated"] == 3 * 2 * 8
    assert summary["samples_dropped"] == 0
    assert len(read_metrics(tmp_path / "groups" / "metrics.jsonl")) == 3  # written by the leader only
    critic = read_metrics(tmp_path / "groups" / "critic_metrics.jsonl")
    assert critic and [r["iteration"] for r in critic] == list(range(len(critic)))
    assert not leftover_shm("t_groups")


def test_sigterm_leaves_a_drain_checkpoint_of_two_rank_trainers(tmp_path):
    """The ranks of each trainer stop together, so the save at the stop (a collective) runs on
    both, at the version they trained, past the periodic checkpoints (every 100 iterations)."""
    process, log = start_run(tmp_path, "drained", "iterations=50", "checkpoint={every: 100, keep: 2}", GROUPS)
    metrics = tmp_path / "drained" / "metrics.jsonl"
    wait_for_iterations(process, log, metrics, 2)
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=120) == 130, log.read_text()[-3000:]
    text = log.read_text()
    assert "ignored shutdown" not in text, text[-3000:]
    saved = sorted((tmp_path / "drained" / "checkpoints").glob("iter-*"))
    assert saved and len(read_metrics(metrics)) >= 2, text[-3000:]
    assert all((saved[-1] / part / "MANIFEST.json").is_file() for part in ("actor", "critic"))
    iteration = int(saved[-1].name[5:])
    assert f"holds iteration {iteration} (policy version {iteration}): continue with" in text


@pytest.mark.parametrize(("victim", "named"), [("follower", r"actor_train-0\.rank1"), ("leader", r"actor_train-0")])
def test_a_dead_rank_fails_the_job_naming_it_and_leaves_no_process(tmp_path, victim, named):
    """Whichever rank dies, the others fail in their next collective (no hang) and the job stops."""
    name = f"dead{victim}"
    process, log = start_run(tmp_path, name, "iterations=50", GROUPS)
    wait_for_iterations(process, log, tmp_path / name / "metrics.jsonl")
    text = log.read_text()
    pids = {"follower": re.search(r"actor_train-0 rank 1 of 2 \(pid (\d+)\)", text),
            "leader": re.search(r"instance actor_train-0 of stage actor_train joined \(pid (\d+)\)", text)}
    assert all(pids.values()), text[-3000:]
    every = [int(p) for p in re.findall(r"\(pid (\d+)\)", text)]
    os.kill(int(pids[victim][1]), signal.SIGKILL)
    assert process.wait(timeout=120) == 1, log.read_text()[-3000:]
    assert re.search(rf"stage instance\(s\) failed: .*{named} \(exit -9\)", log.read_text()), log.read_text()[-3000:]
    assert all(_gone_or_zombie(pid) for pid in every)
    assert not leftover_shm(f"t_{name}")


def kill_a_follower_and_finish(process: subprocess.Popen, log: Path, run_dir: Path) -> str:
    """Once the run's first iteration is in, SIGKILL rank 1 of ref_forward-0; the log once the run
    ended (it must end well: the group restarts)."""
    wait_for_iterations(process, log, run_dir / "metrics.jsonl")
    follower = re.search(r"ref_forward-0 rank 1 of 2 \(pid (\d+)\)", log.read_text())
    assert follower and process.poll() is None, log.read_text()[-3000:]
    os.kill(int(follower[1]), signal.SIGKILL)
    assert process.wait(timeout=240) == 0, log.read_text()[-3000:]
    return log.read_text()


def test_a_restartable_group_restarts_every_rank_and_the_run_completes(tmp_path):
    iterations = 12
    process, log = start_run(tmp_path, "regroup", f"iterations={iterations}", "restarts={ref_forward: 1}",
                             "placement.stages={ref_forward: {ranks: 2}}")
    text = kill_a_follower_and_finish(process, log, tmp_path / "regroup")
    assert "ref_forward-0.rank1 exited with -9: restarting it with every rank of ref_forward-0" in text
    assert len(re.findall(r"ref_forward-0 rank 1 of 2 \(pid \d+\)", text)) == 2  # a new group
    summary = json.loads((tmp_path / "regroup" / "summary.json").read_text())
    assert summary["iterations"] == iterations and summary["samples_trained"] == iterations * 2 * 8
    assert not leftover_shm("t_regroup")


def test_a_vision_language_job_with_two_rank_trainers_keeps_the_vision_tower(tmp_path):
    """FSDP2 shards the frozen vision tower with the rest of the policy: it must come back whole and
    unchanged, and the images are counted once, not once per rank."""
    data = tiny_job(tmp_path, "vlm", broker={"shm_prefix": "t_vlm"}, **VISION)
    config = write_job(tmp_path / "vlm.yaml", data)
    log = tmp_path / "vlm.log"
    groups = "{actor_train: {ranks: 2}, critic_train: {ranks: 2}, ref_forward: {ranks: 2}}"
    sets = ["iterations=2", f"placement.stages={groups}"]
    with log.open("w") as out:
        result = subprocess.run([sys.executable, "-m", "stream_rlhf.cli", "run", str(config),
                                 *(x for s in sets for x in ("--set", s))], stdout=out, stderr=subprocess.STDOUT,
                                timeout=300, check=False)
    assert result.returncode == 0, log.read_text()[-3000:]
    summary = json.loads((tmp_path / "vlm" / "summary.json").read_text())
    assert summary["samples_trained"] == 2 * 2 * 8 and summary["images_seen"] == 2 * 2 * 8
    start = load_file(str(warm_start(resolve_data(build(RLJobConfig, data))) / "model.safetensors"))  # the run's
    trained = load_file(str(tmp_path / "vlm" / "checkpoint" / "model.safetensors"))
    tower = [name for name in start if ".visual." in name or name.startswith("visual.")]
    assert tower and all(torch.equal(trained[name], start[name]) for name in tower)
    language = [name for name in start if name not in tower and "embed_tokens" not in name]
    assert any(not torch.equal(trained[name], start[name]) for name in language)  # the language model trained
    assert not leftover_shm("t_vlm")
