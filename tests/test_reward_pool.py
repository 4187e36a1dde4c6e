"""The reward function in worker processes (`reward.workers`, `rl/reward_pool.py`): the scores of
the stage's own process, several samples at once in processes of their own, a call past
`reward.timeout_s` scored `timeout_score` and its process replaced, and a function that raises
or returns a non-number named with its sample, the pool usable after each; and (slow) the
benchmark's smoke run."""

from __future__ import annotations

import os

import pytest

from stream_rlhf.config import ConfigError
from stream_rlhf.rl.reward_parts_config import ProcessRewardConfig, RewardConfig
from stream_rlhf.rl.reward_pool import OUTCOME, STEPS, RewardError, RewardPool
from tests.bench_run import run_bench_json
from tests.reward_functions import length

STEP_RULE = "stream_rlhf.data.arithmetic:step_reward"


def _calls(*responses: str) -> list[tuple[str, str, str, dict]]:
    return [(f"{i}+{i}=", response, str(2 * i), {}) for i, response in enumerate(responses)]


def test_scores_are_the_functions_in_sample_order():
    pool = RewardPool({OUTCOME: "tests.reward_functions:length"}, workers=2, timeout_s=30, timeout_score=0.0)
    try:
        calls = [*_calls("a", "bbb", "", "cc", "dddd"), ("p", "xy", "r", {"bonus": 0.5})]
        scores, timeouts = pool.run(OUTCOME, calls)
        assert scores == [length(*call[:3], **call[3]) for call in calls] and timeouts == []
        assert pool.run(OUTCOME, []) == ([], [])
        with pytest.raises(ValueError, match="no reward.process.function was given to the pool"):
            pool.run(STEPS, [])
    finally:
        pool.close()


def test_samples_are_scored_at_once_in_processes_of_their_own():
    pool = RewardPool({OUTCOME: "tests.reward_functions:whoami"}, workers=3, timeout_s=30, timeout_score=0.0)
    processes = [worker.process for worker in pool.workers]
    try:
        pids = {int(score) for score in pool.run(OUTCOME, _calls(*"abcdefghi"))[0]}
        assert pids == {process.pid for process in processes} and os.getpid() not in pids
    finally:
        pool.close()
    assert all(process.poll() == 0 for process in processes)  # each ended as its socket closed


def test_a_call_past_its_timeout_scores_the_timeout_score_and_its_process_is_replaced():
    pool = RewardPool({OUTCOME: "tests.reward_functions:fussy"}, workers=2, timeout_s=1.0, timeout_score=-1.0)
    try:
        first = [worker.process for worker in pool.workers]
        scores, timeouts = pool.run(OUTCOME, _calls("x", "hang", "y", "z"))
        assert scores == [1.0, -1.0, 1.0, 1.0] and pool.replaced == 1
        assert timeouts == ["sample 1 (reference '2'): tests.reward_functions:fussy ran past reward.timeout_s=1.0; "
                            "scored -1.0"]
        killed = [process for process in first if process.poll() is not None]
        assert len(killed) == 1 and killed[0].returncode < 0  # killed, with the call it could not get back
        assert pool.run(OUTCOME, _calls("a", "b", "c")) == ([1.0, 1.0, 1.0], [])  # the replacement scores
    finally:
        pool.close()


@pytest.mark.parametrize(("response", "message"), [
    ("bad", r"sample 2 \(reference '4'\): tests.reward_functions:fussy raised ValueError: cannot read 'bad'"),
    ("nan", r"sample 2 \(reference '4'\): tests.reward_functions:fussy returned nan, expected a finite number"),
])
def test_a_function_that_fails_names_the_sample_and_the_pool_goes_on(response, message):
    pool = RewardPool({OUTCOME: "tests.reward_functions:fussy"}, workers=2, timeout_s=30, timeout_score=0.0)
    try:
        with pytest.raises(RewardError, match=message):
            pool.run(OUTCOME, _calls("a", "b", response, "c", "d"))
        assert pool.run(OUTCOME, _calls("a", "b")) == ([1.0, 1.0], [])  # no reply of the failed call is left over
    finally:
        pool.close()


def test_the_process_rule_runs_beside_the_outcome_in_the_same_workers():
    pool = RewardPool({OUTCOME: "tests.reward_functions:length", STEPS: "tests.reward_functions:step_lengths"},
                      workers=2, timeout_s=1.0, timeout_score=-1.0)
    try:
        steps = [("1+2+3=", ["3", "66"], "3,6", {}), ("p", ["hang", "x"], "r", {}), ("q", [], "r", {})]
        scores, timeouts = pool.run(STEPS, steps)
        assert scores == [[1.0, 2.0], [-1.0, -1.0], []] and pool.replaced == 1
        assert timeouts == ["sample 1 (reference 'r'): tests.reward_functions:step_lengths ran past "
                            "reward.timeout_s=1.0; scored -1.0 for each step"]
        assert pool.run(OUTCOME, _calls("ab", "")) == ([2.0, 0.0], [])  # the same workers, the other function
        with pytest.raises(RewardError, match=r"sample 0 \(reference 'r'\): tests.reward_functions:step_lengths "
                                              r"returned 'odd', expected a list of finite numbers"):
            pool.run(STEPS, [("p", ["odd"], "r", {})])
    finally:
        pool.close()


def test_a_function_that_does_not_import_fails_the_pool_naming_it():
    with pytest.raises(RewardError, match=r"reward.workers: ConfigError: reward.function='tests.reward_functions:nope'"
                                          r": module tests.reward_functions has no nope"):
        RewardPool({OUTCOME: "tests.reward_functions:nope"}, workers=1, timeout_s=30, timeout_score=0.0)


def test_the_config_names_what_it_refuses():
    with pytest.raises(ConfigError, match="workers=-1: must be >= 0"):
        RewardConfig(workers=-1)
    with pytest.raises(ConfigError, match="workers=2: there is no reward function"):
        RewardConfig(function=None, workers=2, model_path=None)
    only_steps = RewardConfig(function=None, workers=2, process=ProcessRewardConfig(function=STEP_RULE))
    assert only_steps.pooled_functions() == {STEPS: STEP_RULE}
    with pytest.raises(ConfigError, match="timeout_s=0"):
        RewardConfig(workers=2, timeout_s=0)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bench_reward_workers_quick_json(tmp_path):
    figures, stdout = run_bench_json("bench/reward_workers.py", tmp_path, timeout_s=280)
    assert figures["baseline"] == "in_process" and figures["in_process_speedup"] == 1.0
    assert all(figures[f"{column}_samples_per_s"] > 0 for column in ("in_process", "workers1", "workers2"))
    assert "ms of pure Python per sample" in stdout
