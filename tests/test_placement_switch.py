"""`placement.replan: switch` (`driver/placement_switch.py`, `driver/replan.py`): when the re-plan
switches the running job, and what the driver records, without running a job (the slow test
in `tests/test_placement_switch_job.py` runs one). The machine figures are
`tests/test_auto_placement.py`'s."""

from __future__ import annotations

from pathlib import Path

import pytest

from stream_rlhf.config import ConfigError, load_config
from stream_rlhf.driver.placement_switch import (
    decide,
    placements_used,
    planned_switch,
    restart_estimate,
    switched_config,
)
from stream_rlhf.driver.replan import FORCE_SWITCH_VARIABLE, ReplanWatch
from stream_rlhf.driver.resume import read_switches, record_start
from stream_rlhf.planner.auto_placement import choose_placement, replan, with_placement
from stream_rlhf.resume.store import ResumePoint
from stream_rlhf.rl.config import RLJobConfig
from tests.test_auto_placement import LONG_ANSWERS, MACHINE, job

SWITCH = ["placement.replan=switch", "iterations=40"]


def records(first_s: float = 2.0, then_s: float = 0.5, tokens: float = 3.0, count: int = 5) -> list[dict]:
    """metrics.jsonl's first iterations: the first pays for the start-up."""
    return [{"iteration": i, "iteration_s": first_s if i == 0 else then_s, "response_len": tokens}
            for i in range(count)]


@pytest.fixture(scope="module")
def planned() -> tuple[RLJobConfig, object, object]:
    """Planned for bench/pipeline.py's 48-token answers under `switch`: the running config, its
    dataflow and auto's choice."""
    cfg, flow = job(*LONG_ANSWERS, *SWITCH)
    choice = choose_placement(cfg, flow, MACHINE)
    return with_placement(cfg, choice.chosen), flow, choice


@pytest.fixture(scope="module")
def drift(planned) -> dict:
    """Re-planned at 3-token answers: a critic stage on rollout's cores is faster
    (`test_replan_names_a_faster_placement_...`)."""
    return replan(*planned, 3.0, 0.5, 5)


def test_a_faster_placement_is_switched_to_only_under_switch_once_and_with_iterations_left(planned, drift):
    cfg = planned[0]
    assert drift["better"] is not None
    assert decide(cfg, drift, done=5, restart_s=1.0, switched_before=False).switch
    warn = decide(with_placement(cfg, {"replan": "warn"}), drift, done=5, restart_s=1.0, switched_before=False)
    assert not warn.switch and "placement.replan=warn" in warn.why
    again = decide(cfg, drift, done=5, restart_s=1.0, switched_before=True)
    assert not again.switch and "switched placement already" in again.why
    late = decide(cfg, drift, done=39, restart_s=1.0, switched_before=False)
    assert not late.switch and "1 of iterations=40 left" in late.why
    assert not decide(cfg, {**drift, "better": None}, done=5, restart_s=1.0, switched_before=False).switch


def test_a_switch_must_pay_for_its_restart(planned, drift):
    """The gain: predicted seconds saved per iteration, scaled to the measured iteration time, over
    the iterations left; the restart: the job's start-up before its first iteration."""
    cfg = planned[0]
    saved_per_iteration = (drift["running_predicted_now_s"] - drift["better"]["predicted_iteration_s"]) \
        * drift["measured_iteration_s"] / drift["running_predicted_now_s"]
    left = 10
    gain = saved_per_iteration * left
    pays = decide(cfg, drift, 40 - left, restart_s=gain * 0.9, switched_before=False)
    assert pays.switch and f"predicted gain {gain:.1f} s over the {left} iterations left" in pays.why
    costly = decide(cfg, drift, 40 - left, restart_s=gain * 1.1, switched_before=False)
    assert not costly.switch and "does not pay for a restart" in costly.why
    assert decide(cfg, drift, 40 - left, restart_s=gain * 1.1, switched_before=False, forced=True).switch


def test_the_restart_is_costed_from_the_job_s_start_up():
    """Seen: 6 s from the processes' start to the first record, of which one steady iteration
    (0.5 s) is not start-up; not seen: the first iteration's excess over the others."""
    assert restart_estimate(records(), first_record_s=6.0) == pytest.approx(5.5)
    assert restart_estimate(records(first_s=2.0), first_record_s=None) == pytest.approx(1.5)
    assert restart_estimate(records(count=1), first_record_s=None) == pytest.approx(2.0)


def test_the_watch_drains_the_job_once_and_plans_the_switch(planned, monkeypatch):
    cfg, flow, choice = planned
    drains = []
    watch = ReplanWatch(cfg, flow, choice, None, may_switch=True, on_switch=lambda: drains.append(1))
    watch.check(records(), done=6)
    assert drains == [1] and watch.result["switch"]["switched"]
    switch = watch.switch
    assert switch.from_placement == choice.placement and switch.to_placement["with_rollout"] \
        == watch.result["better"]["with_rollout"] != choice.placement["with_rollout"]
    assert switch.predicted_to_s < switch.predicted_from_s
    assert switch.auto == choice.as_dict() and switch.replan is watch.result
    assert "placement: switching at iteration 6 from separated with_rollout=[] to separated with_rollout=[" \
        in switch.describe(6)
    # a run that switched before: a warning, no drain
    watch = ReplanWatch(cfg, flow, choice, None, may_switch=False, on_switch=lambda: drains.append(2))
    watch.check(records(), done=6)
    assert drains == [1] and watch.switch is None
    # answers as planned: nothing faster, unless the test hook forces the fastest other placement
    watch = ReplanWatch(cfg, flow, choice, None, may_switch=True, on_switch=lambda: drains.append(3))
    watch.check(records(tokens=48.0), done=6)
    assert drains == [1] and watch.result["better"] is None
    monkeypatch.setenv(FORCE_SWITCH_VARIABLE, "1")
    watch.check(records(tokens=48.0), done=6)
    assert drains == [1, 3] and watch.switch.predicted_to_s >= watch.switch.predicted_from_s
    assert "forced by the test hook" in watch.result["switch"]["why"]


def test_the_switch_is_recorded_and_the_next_leg_runs_the_new_placement(planned, drift, tmp_path: Path):
    switch = planned_switch(planned[2], drift)
    loaded = load_config(RLJobConfig, "configs/text_ppo.yaml", [*LONG_ANSWERS, *SWITCH])  # as the CLI loaded it
    record_start(tmp_path, loaded, {}, "start")
    with pytest.raises(ConfigError, match="left no complete checkpoint"):
        switched_config(loaded, tmp_path, switch, None)
    next_leg = switched_config(loaded, tmp_path, switch, ResumePoint(7, tmp_path / "iter-7"))
    assert next_leg.placement.auto == ()  # every key explicit: auto does not choose again, no second re-plan
    assert next_leg.placement.with_rollout == switch.to_placement["with_rollout"]
    [recorded] = read_switches(tmp_path)
    assert recorded["iteration"] == 7 and recorded["to"] == switch.to_placement
    assert recorded["predicted_iteration_s"] == {"from": switch.predicted_from_s,
                                                 "to": switch.predicted_to_s}
    used = placements_used(switch.to_placement, read_switches(tmp_path))
    assert [u["from_iteration"] for u in used] == [0, 7]
    assert used[0]["with_rollout"] == planned[2].placement["with_rollout"] != used[1]["with_rollout"]
    assert placements_used(planned[2].placement, []) == [{"from_iteration": 0, **planned[2].placement}]


def test_the_flag_is_checked_where_it_is_given():
    with pytest.raises(ConfigError, match=r"placement.replan='often'"):
        job("placement.replan=often")
    assert job()[0].placement.replan == "warn"
