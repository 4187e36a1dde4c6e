"""A stage pinned to its cores starts its worker processes (`env.processes`, `reward.workers`) on
every core it had before pinning (`worker_process.HELPER_CORES`): not on its own core, where their
work would compete with the stage and two workers could not run at once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
STAGE = """
import json, os
from stream_rlhf.launch.rank import _pin
from stream_rlhf.launch.spec import StageSpec
from stream_rlhf.rl.reward_pool import OUTCOME, RewardPool

_pin(StageSpec(cls="stream_rlhf.demo.stages:ToyForward", cores=[0]), 0)  # as a stage's rank does first
pool = RewardPool({OUTCOME: "tests.reward_functions:whoami"}, workers=2, timeout_s=30, timeout_score=0.0)
try:
    pool.run(OUTCOME, [("p", "r", "x", {})])  # the workers are up and working
    print(json.dumps({"stage": sorted(os.sched_getaffinity(0)),
                      "workers": [sorted(os.sched_getaffinity(w.process.pid)) for w in pool.workers]}))
finally:
    pool.close()
"""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores: the stage on one, its workers on both")
def test_the_workers_of_a_pinned_stage_run_on_the_cores_it_had_before():
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("STREAM_RLHF_HELPER_CORES", None)
    out = subprocess.run([sys.executable, "-c", STAGE], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=120, check=True).stdout
    cores = json.loads(out.strip().splitlines()[-1])
    assert cores["stage"] == [0]
    assert cores["workers"] == [sorted(os.sched_getaffinity(0))] * 2
