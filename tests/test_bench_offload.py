"""bench/offload.py's pure parts: the three columns' `--set` lines, and the figures it reads from
runs' summaries (the runs themselves: `.venv/bin/python bench/offload.py --quick`)."""

from __future__ import annotations

import json
import math
import sys
from dataclasses import replace

import pytest
import yaml

from stream_rlhf.config import load_config
from stream_rlhf.rl.config import RLJobConfig
from tests.bench_run import REPO

sys.path.insert(0, str(REPO / "bench"))
import offload  # noqa: E402 - bench/ scripts import each other by file name


def values(overrides: list[str]) -> dict[str, object]:
    """`--set` lines as load_config reads them: dotted key -> YAML value."""
    return {key: yaml.safe_load(raw) for key, _, raw in (o.partition("=") for o in overrides)}


def test_only_full_offload_changes_the_schedule():
    assert offload.schedule_overrides("separate") == offload.schedule_overrides("pipelined") == []
    assert offload.schedule_overrides("spawned") == []
    assert values(offload.schedule_overrides("full_offload")) == {"schedule": "sync", "overlap_depth": 0}
    with pytest.raises(ValueError, match="one of spawned, separate, full_offload, pipelined"):
        offload.schedule_overrides("colocated")


def test_groups_and_offloads_cover_the_model_stages_the_job_has():
    sets = values(offload.group_overrides(["ref_forward", "critic_forward", "reward_forward", "actor_train",
                                           "critic_train"]))
    assert sets.pop("placement.device_groups") == {"forwards": ["ref_forward", "critic_forward", "reward_forward"],
                                                   "trainers": ["actor_train", "critic_train"]}
    assert sets.pop("placement.with_rollout") == []  # each group on the train side's cores, whole
    assert sets == {
        "placement.stages.ref_forward.offload": {"what": ["params"], "when": "step"},
        "placement.stages.critic_forward.offload": {"what": ["params"], "when": "step"},
        "placement.stages.actor_train.offload": {"what": ["params", "grads", "optimizer"], "when": "step"},
        "placement.stages.critic_train.offload": {"what": ["params", "grads", "optimizer"], "when": "step"},
    }
    sync = values(offload.group_overrides(["actor_forward", "ref_forward", "actor_train"]))
    assert sync["placement.device_groups"] == {"forwards": ["actor_forward", "ref_forward"],
                                               "trainers": ["actor_train"]}
    assert "placement.stages.critic_train.offload" not in sync
    pipelined = values(offload.group_overrides(["ref_forward", "actor_train"], prefetch=True))
    assert pipelined["placement.stages.ref_forward.offload"] == {"what": ["params"], "when": "step", "prefetch": True}


def test_the_main_jobs_model_stages_follow_its_schedule():
    """Streaming with overlap_depth 1 has no actor_forward (actor_train recomputes the proximal
    log-probs); sync has one, and it joins the forwards group."""
    config = REPO / offload.CONFIG
    stream = load_config(RLJobConfig, config, offload.schedule_overrides("pipelined"))
    sync = load_config(RLJobConfig, config, offload.schedule_overrides("full_offload"))
    assert offload.model_stages(stream) == ["ref_forward", "critic_forward", "reward_forward", "actor_train",
                                            "critic_train"]
    assert offload.model_stages(sync) == ["actor_forward", "ref_forward", "critic_forward", "reward_forward",
                                          "actor_train", "critic_train"]
    assert offload.column_overrides("separate", offload.QUICK, "px") == [
        "name=bench_offload_quick_separate", "iterations=3", "broker.shm_prefix=px", "placement.device=cpu"]
    assert offload.run_name("pipelined", replace(offload.FULL, device="cuda")) == "bench_offload_cuda_pipelined"
    assert offload.column_overrides("spawned", offload.QUICK, "px")[1:] == ["iterations=3", "broker.shm_prefix=px",
                                                                         "placement.device=cpu"]


def memory(per_process: dict[str, float], peak: float) -> dict:
    return {"peak_pss_mb": peak, "peak_rss_mb": 2 * peak, "processes": len(per_process),
            "per_process": {name: {"peak_pss_mb": mb, "peak_uss_mb": mb, "peak_rss_mb": mb}
                            for name, mb in per_process.items()}}


def write_run(run_dir, iteration_s: list[float], mem: dict | None, moved: dict | None = None) -> None:
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps({"iteration": i, "iteration_s": s}) + "\n"
                                                   for i, s in enumerate(iteration_s)))
    (run_dir / "summary.json").write_text(json.dumps({
        "memory": mem, "offload": moved, "tokens_per_s": 100.0, "samples_dropped": 0, "eval_reward_after": 0.5,
        "job_s": 9.0}))


def test_figures_from_four_runs(tmp_path):
    spawned = {"broker": 200, "rollout-0": 500, "ref_forward-0": 500}
    separate = {"broker": 100, "rollout-0": 300, "ref_forward-0": 300, "critic_forward-0": 300,
                "actor_train-0": 350, "critic_train-0": 350, "critic_train-0.rank1": 50}
    grouped = {"broker": 100, "rollout-0": 300, "forwards-0": 320, "trainers-0": 400}
    write_run(tmp_path / "spawned", [9.0, 2.0, 2.0, 2.0], memory(spawned, 2750.0))
    write_run(tmp_path / "separate", [9.0, 2.0, 2.0, 4.0], memory(separate, 1600.0))
    write_run(tmp_path / "full_offload", [9.0, 5.0, 3.0, 4.0], memory(grouped, 1000.0))
    moved = {stage: {"offload_mb": 10.0, "onload_mb": 8.0, "offload_s": 0.5, "onload_s": 0.25, "onload_hidden_s": 0.2}
             for stage in ("ref_forward", "actor_train")}
    write_run(tmp_path / "pipelined", [9.0, 3.0, 3.0, 3.0], memory(grouped, 1100.0), moved)
    groups = {"forwards": ["ref_forward", "critic_forward"], "trainers": ["actor_train", "critic_train"]}
    results = {column: offload.analyse(tmp_path / column, skip=1, groups={} if column in ("spawned", "separate")
                                       else groups) for column in offload.COLUMNS}
    assert results["separate"]["grouped_pss_mb"] == 300 + 300 + 350 + 350 + 50  # every rank of a grouped stage
    assert results["pipelined"]["grouped_pss_mb"] == 320 + 400
    assert results["full_offload"]["iteration_s"] == 4.0  # the first iteration left out
    assert (results["pipelined"]["moved_mb"], results["pipelined"]["moving_s"]) == (36.0, 1.5)
    assert (results["separate"]["moved_mb"], results["separate"]["moving_s"]) == (0, 0)  # no policies
    assert results["pipelined"]["onload_hidden"] == pytest.approx(0.8)
    assert math.isnan(results["separate"]["onload_hidden"])
    assert all(math.isnan(x) for x in offload.offload_moved({"memory": {}}))  # a summary from before offloads
    figures = offload.figures(results)
    assert figures["peak_mem_separate"] == 1600.0
    assert figures["peak_mem_groups"] == 1100.0  # the larger of the two group columns
    assert figures["peak_mem_groups_over_separate"] == round(1100 / 1600, 3)
    assert figures["peak_mem_groups_over_spawned"] == 0.4
    assert [figures[f"iter_s_{column}"] for column in offload.COLUMNS] == [2.0, 2.667, 4.0, 3.0]
    assert figures["processes_separate"] == 7 and figures["processes_pipelined"] == 4
    table = offload.format_table(results, offload.QUICK)
    assert "device groups' peak / separate: 0.69 (target <= 0.6: MISS)" in table
    assert "device groups' peak / separate spawned (the launcher before its fork server): 0.40 (target <= 0.6: PASS)" \
        in table
    assert "pipelined faster than full offload: PASS" in table


def test_a_run_without_a_memory_block_is_an_error(tmp_path):
    write_run(tmp_path / "ray", [1.0, 1.0], None)
    with pytest.raises(RuntimeError, match="no memory block"):
        offload.analyse(tmp_path / "ray", skip=1, groups={})


def test_the_cuda_peak_of_a_job_counts_each_process_once():
    """Members of a device group report their one process's peak; separate stages add up."""
    peaks = {"cuda_peak_allocated_mb": {"rollout": 50.0, "ref_forward": 80.0, "critic_forward": 81.0,
                                        "actor_train": 190.0, "critic_train": 192.0}}
    groups = {"forwards": ["ref_forward", "critic_forward"], "trainers": ["actor_train", "critic_train"]}
    assert offload.cuda_peak_mb(peaks, groups) == 50 + 81 + 192
    assert offload.cuda_peak_mb(peaks, {}) == 50 + 80 + 81 + 190 + 192
    assert math.isnan(offload.cuda_peak_mb({}, groups))  # on a CPU no stage reports one
