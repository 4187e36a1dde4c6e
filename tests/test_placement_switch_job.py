"""`placement.replan: switch` on a tiny real job: the re-plan (forced by its test hook) drains the
stages, and the driver resumes the job from the drain's checkpoint with another placement.

An unswitched run of this job generates and trains each of its iterations' samples once
(iterations x 2 mini-batches x 8 prompts: `tests/test_rl_job.py`, `tests/test_resume_job.py`);
the switched run must give the same counts. It starts with a critic warm-up, so its iterations
and policy versions differ: the re-plan waits for the actor's first iteration, and the resumed
leg starts at the checkpoint's policy version, not its iteration count."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from stream_rlhf.driver.replan import FORCE_SWITCH_VARIABLE
from stream_rlhf.resume.background_writer import WRITE_DELAY_VARIABLE
from stream_rlhf.telemetry.metrics import read_metrics
from tests.rl_tiny import tiny_job, write_job

pytestmark = pytest.mark.slow
ITERATIONS, PER_ITERATION, WARMUP = 10, 2 * 8, 2
WRITE_DELAY_S = "1.0"
"""Each checkpoint write (every 2 iterations, training waiting for it) lasts this much longer, so
that the tiny job's iterations outlast the re-plan (a look at metrics.jsonl every 0.25 s, then
~1 s of predictions): the switch then comes with iterations left to switch for."""


def test_a_forced_switch_moves_the_job_at_a_checkpoint_and_it_trains_every_sample_once(tmp_path: Path):
    data = tiny_job(tmp_path, "switch", iterations=ITERATIONS, overlap_depth=1, broker={"shm_prefix": "s_switch"},
                    placement={"mode": "separated", "rollout_cores": [0], "train_cores": [min(1, os.cpu_count() - 1)],
                               "with_rollout": "auto", "replan": "switch", "replan_after": 1},
                    checkpoint={"every": 2, "background": False}, critic={"warmup_iterations": WARMUP})
    config = write_job(tmp_path / "switch.yaml", data)
    log = tmp_path / "switch.log"
    hooks = {FORCE_SWITCH_VARIABLE: "1", WRITE_DELAY_VARIABLE: WRITE_DELAY_S}
    with log.open("w") as out:
        process = subprocess.run([sys.executable, "-m", "stream_rlhf.cli", "run", str(config)], stdout=out,
                                 stderr=subprocess.STDOUT, env={**os.environ, **hooks}, timeout=300)
    text = log.read_text()
    assert process.returncode == 0, text[-3000:]
    run_dir = tmp_path / "switch"
    summary = json.loads((run_dir / "summary.json").read_text())
    placement = summary["placement"]
    [switch] = placement["switches"]
    at = switch["iteration"]
    assert WARMUP + 1 <= at < ITERATIONS  # after the actor's first iteration (the warm-up's train no actor)
    assert f"placement: switching at iteration {at} from separated with_rollout=" in text
    assert "forced by the test hook" in text
    # two placements, the second from the switch's iteration on, and the second leg ran it
    first, second = placement["used"]
    assert (first["from_iteration"], second["from_iteration"]) == (0, at)
    assert first["with_rollout"] != second["with_rollout"] == placement["running"]["with_rollout"]
    assert switch["from"]["with_rollout"] == first["with_rollout"] == placement["auto"]["placement"]["with_rollout"]
    assert placement["replan"]["switch"]["switched"] and set(switch["predicted_iteration_s"]) == {"from", "to"}
    plan = json.loads((run_dir / "plan.json").read_text())  # the second leg's plan
    cores = {r["stage"]: r["cores"] for r in plan["ranks"]}
    for stage in second["with_rollout"]:
        assert cores[stage] == cores["rollout"]
    # resumed once, from the drain's checkpoint: every iteration trained once, the weights continue
    assert summary["resumed_from"] == [at]
    records = read_metrics(run_dir / "metrics.jsonl")
    assert [r["iteration"] for r in records] == list(range(ITERATIONS))
    assert [r["policy_version"] for r in records] == [0] * WARMUP + list(range(1, ITERATIONS - WARMUP + 1))
    resumed = re.findall(r"actor_train-0 .*resumed from \S+ at policy version (\d+)", text)
    assert [int(version) for version in resumed] == [at - WARMUP], resumed
    assert all(r["staleness_max"] <= 1 for r in records)
    # the sample accounting of an unswitched run: each generated once and trained once
    assert summary["iterations"] == ITERATIONS and summary["samples_critic_warmup"] == WARMUP * PER_ITERATION
    assert summary["samples_generated"] == summary["samples_trained"] == ITERATIONS * PER_ITERATION
    assert summary["samples_dropped"] == summary["samples_discarded_at_resume"] == 0
    assert summary["samples_in_flight_at_stop"] == 0
