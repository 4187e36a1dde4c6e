"""`stream-rlhf run` on a tiny RL job, as a user runs it: real broker, one process per stage."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from stream_rlhf.telemetry.metrics import read_metrics
from stream_rlhf.telemetry.stage_counts import FOLDER as COUNTS
from tests.rl_tiny import tiny_job, write_job
from tests.waiting import wait_for

pytestmark = pytest.mark.slow
SUMMARY_KEYS = {"eval_reward_before", "eval_reward_after", "tokens_per_s", "wall_s", "iterations", "samples_trained",
                "samples_generated", "samples_dropped", "dropped_reasons"}


def start_run(tmp_path: Path, name: str, *sets: str) -> tuple[subprocess.Popen, Path]:
    config = write_job(tmp_path / f"{name}.yaml", tiny_job(tmp_path, name, broker={"shm_prefix": f"t_{name}"}))
    log = tmp_path / f"{name}.log"
    with log.open("w") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "stream_rlhf.cli", "run", str(config), *(x for s in sets for x in ("--set", s))],
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )
    return process, log


def leftover_shm(prefix: str) -> list[str]:
    return [n for n in os.listdir("/dev/shm") if n.startswith(prefix)]


def wait_for_iterations(process: subprocess.Popen, log: Path, metrics: Path, iterations: int = 1,
                        timeout_s: float = 180) -> None:
    """Until `metrics` holds `iterations` lines; fails with the log's tail if the run ended first."""
    def written() -> bool:
        if len(read_metrics(metrics)) >= iterations:
            return True
        assert process.poll() is None, log.read_text()[-3000:]
        return False

    wait_for(written, timeout_s, f"{iterations} iteration(s) in {metrics}", detail=lambda: log.read_text()[-3000:])


def test_tiny_ppo_run_writes_a_consistent_summary(tmp_path):
    process, log = start_run(tmp_path, "e2e", "overlap_depth=1", "iterations=3", "placement.mode=separated",
                             "placement.with_rollout=auto", "placement.replan_after=2")
    assert process.wait(timeout=240) == 0, log.read_text()[-3000:]
    run_dir = tmp_path / "e2e"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert SUMMARY_KEYS <= summary.keys()
    assert summary["iterations"] == 3
    assert summary["samples_generated"] == 3 * 2 * 8
    assert summary["samples_generated"] == (summary["samples_trained"] + summary["samples_dropped"]
                                            + summary["samples_in_flight_at_stop"])
    assert summary["samples_dropped"] == 0
    records = read_metrics(run_dir / "metrics.jsonl")
    assert all(r["staleness_max"] <= 1 for r in records)  # never older than overlap_depth...
    assert max(r["staleness_max"] for r in records) == 1  # ...though rollout did run ahead
    for record in records:  # the loss clips against the weights training starts from...
        if record["staleness_max"] == 1:  # ...recomputed when rollout ran ahead of them
            assert record["proximal_recomputed"] == 1
    assert (run_dir / "checkpoint" / "model.safetensors").is_file()
    assert "eval_reward_after" in log.read_text()  # the summary table was printed
    # separated on the CPU, every stage takes part in core lending; the tiny model never borrows
    assert ("actor_train-0: borrowed the other side's cores 0 times (no model big enough to gain from more "
            "threads)") in log.read_text()
    assert not leftover_shm("t_e2e")
    memory = summary["memory"]  # sampled from the broker and every stage process while they ran
    plan = json.loads((run_dir / "plan.json").read_text())
    # the broker, every stage process, and the fork server they were forked from (launch/process_start.py)
    assert memory["per_process"].keys() == {r["process"] for r in plan["ranks"]} | {"fork_server"}
    assert memory["processes"] == len(memory["per_process"]) and memory["samples"] >= 2
    pss = [p["peak_pss_mb"] for p in memory["per_process"].values()]
    assert max(pss) <= memory["peak_pss_mb"] <= sum(pss) and min(pss) > 0
    assert "peak PSS" in log.read_text()  # its line in the log and the table
    # placement auto chose with_rollout (mode was given), the plan and the summary say so and why
    auto = summary["placement"]["auto"]
    assert auto["decided"] == ["with_rollout", "device_groups"] and auto["placement"]["mode"] == "separated"
    assert plan["placement_auto"] == auto and summary["placement"]["running"]["with_rollout"] == auto["placement"][
        "with_rollout"]
    assert auto["predicted_iteration_s"] > 0 and "answers of 4 tokens" in auto["why"]
    assert auto["summary"] in log.read_text()
    replan = summary["placement"]["replan"]  # after 2 iterations: measured against predicted
    assert replan["after_iterations"] == 2 and replan["measured_iteration_s"] > 0
    assert 0 < replan["response_tokens"]["measured"] <= 4 == replan["response_tokens"]["planned"]
    assert "placement re-plan after 2 iterations" in log.read_text()


def test_killed_stage_stops_the_run_with_a_clear_message_and_no_orphans(tmp_path):
    # no restart, no recovery: the launcher's own reaction to a crash (tests/test_resume_job.py has the rest)
    process, log = start_run(tmp_path, "kill", "iterations=50", "overlap_depth=1", "restarts={rollout: 0}",
                             "checkpoint.recoveries=0")
    wait_for_iterations(process, log, tmp_path / "kill" / "metrics.jsonl")
    joined = re.findall(r"instance (\S+) of stage \S+ joined \(pid (\d+)\)", log.read_text())
    pids = {name: int(pid) for name, pid in joined}
    assert "rollout-0" in pids, log.read_text()[-3000:]
    os.kill(pids["rollout-0"], signal.SIGKILL)
    assert process.wait(timeout=60) == 1
    text = log.read_text()
    assert re.search(r"stage instance\(s\) failed: rollout-0 \(exit -9\)", text), text[-3000:]
    for name, pid in pids.items():
        assert _gone_or_zombie(pid), f"{name} (pid {pid}) outlived the run"
    assert not leftover_shm("t_kill")
    assert not (tmp_path / "kill" / "summary.json").exists()


def test_ctrl_c_drains_and_stops_everything(tmp_path):
    """Every stage process, and the reward function's own (reward.workers), is gone after Ctrl-C."""
    process, log = start_run(tmp_path, "sigint", "iterations=50", "reward.workers=2")
    wait_for_iterations(process, log, tmp_path / "sigint" / "metrics.jsonl")
    text = log.read_text()
    pids = [int(p) for p in re.findall(r"joined \(pid (\d+)\)", text)]
    reward_pids = [int(p) for line in re.findall(r"reward.function \S+ in 2 processes \(pids ([\d, ]+)\)", text)
                   for p in line.split(", ")]
    os.killpg(process.pid, signal.SIGINT)  # what a terminal sends to the foreground group
    assert process.wait(timeout=60) == 130, log.read_text()[-3000:]
    assert "interrupted: draining every stage" in log.read_text()
    assert pids and all(_gone_or_zombie(pid) for pid in pids)
    assert len(reward_pids) >= 2 and all(_gone_or_zombie(pid) for pid in reward_pids)  # the stage's, the eval's
    assert not leftover_shm("t_sigint")  # payload segments and the weight versions


@pytest.mark.parametrize("transport", ["shm", "broadcast"])
def test_a_restartable_stage_is_restarted_and_the_run_completes(tmp_path, transport):
    """With broadcast the new rollout joins its weight-sync group anew (the trainer's sender opens
    it again) and gets the newest version, where it was once refused a restart."""
    iterations = 20  # enough that the kill lands mid-run on a fast machine too
    process, log = start_run(tmp_path, "restart", f"iterations={iterations}", "restarts={rollout: 1}",
                             f"weights.transport={transport}")
    metrics = tmp_path / "restart" / "metrics.jsonl"
    wait_for_iterations(process, log, metrics)
    pid = int(re.search(r"instance rollout-0 of stage rollout joined \(pid (\d+)\)", log.read_text())[1])
    os.kill(pid, signal.SIGKILL)
    assert process.wait(timeout=240) == 0, log.read_text()[-3000:]
    text = log.read_text()
    assert "rollout-0 exited with -9: restarting it in " in text
    pids = [int(p) for p in re.findall(r"instance rollout-0 of stage rollout joined \(pid (\d+)\)", text)]
    assert pids[0] == pid and len(pids) == 2, pids  # the killed process, then the one that replaced it
    summary = json.loads((tmp_path / "restart" / "summary.json").read_text())
    assert summary["iterations"] == iterations and summary["samples_trained"] == iterations * 2 * 8
    assert summary["samples_generated"] >= summary["samples_trained"]
    # the kill landed mid-run: the new process generated samples (each process counts its own)
    generated = json.loads((tmp_path / "restart" / COUNTS / f"rollout-0-{pids[1]}.json").read_text())
    assert generated["counts"]["generated"] > 0, generated
    assert summary["samples_dropped"] == 0 and summary["max_staleness"] <= 1
    if transport == "broadcast":
        assert "weight-sync group 'rollout-0': the restarted receiver joined" in text
    assert not leftover_shm("t_restart")


def _gone_or_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except FileNotFoundError:
        return True
