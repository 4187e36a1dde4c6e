"""The table at the end of `stream-rlhf run` (driver/summary_table.py): every figure of summary.json
on a row of its own, the placement block in words, and nothing cut or eaten as rich markup."""

from __future__ import annotations

from rich.console import Console

from stream_rlhf.driver.summary_table import print_summary, summary_rows

PLACEMENT = {"mode": "separated", "with_rollout": ["ref_forward", "reward_forward"], "device_groups": {}}
GROUPED = {"mode": "colocated", "with_rollout": [], "device_groups": {"g0": ["ref_forward", "actor_train"]}}
SUMMARY = {
    "name": "text_tool_grpo",
    "stages_left_out": {"critic_forward": "algorithm.advantage=grpo has no critic"},
    "iterations": 6,
    "dropped_reasons": {},
    "resumed_from": [],
    "lines_skipped": {"train": {"not JSON": 2}, "eval": {}},
    "plots": ["runs/a-run-with-a-rather-long-name/plots/reward.png", "runs/a-run-with-a-rather-long-name/plots/kl.png"],
    "trace": {"busy": {"rollout": 0.39}, "bubble_ratio": 0.29},
    "placement": {
        "running": GROUPED,
        "auto": {"summary": "placement auto: mode=separated, with_rollout=[ref_forward, reward_forward]: why",
                 "candidates": [{**PLACEMENT, "predicted_iteration_s": 1.08}], "why": "why"},
        "replan": {"after_iterations": 5, "measured_iteration_s": 0.75, "predicted_iteration_s": 1.09,
                   "response_tokens": {"planned": 49.3, "measured": 22.1}, "running_predicted_now_s": 0.64,
                   "margin": 0.1, "better": {"mode": "colocated", "predicted_iteration_s": 0.5},
                   "switch": {"switched": True, "why": "0.64 -> 0.5 s"}},
        "used": [{"from_iteration": 0, **PLACEMENT}, {"from_iteration": 5, **GROUPED}],
        "switches": [{"iteration": 5, "from": PLACEMENT, "to": GROUPED, "predicted_iteration_s": 0.5}]},
    "offload": None,
    "episodes": {"count": 768, "ended": {"done": 767, "max_episode_tokens": 1}},
    "episodes_failed": {"env_raised": 3},
}


def test_each_figure_is_a_row_of_its_own_and_no_mapping_is_printed_raw():
    rows = dict(summary_rows(SUMMARY))
    assert "name" not in rows
    assert rows["stages_left_out.critic_forward"] == "algorithm.advantage=grpo has no critic"
    assert rows["lines_skipped.train.not JSON"] == "2"
    assert rows["lines_skipped.eval"] == rows["dropped_reasons"] == rows["resumed_from"] == "none"
    assert rows["offload"] == "-"
    assert rows["plots"].splitlines() == SUMMARY["plots"]
    assert rows["trace.busy.rollout"] == "0.39"
    assert rows["episodes.ended.max_episode_tokens"] == "1"
    assert rows["episodes_failed.env_raised"] == "3"
    assert not [label for label, shown in rows.items() if "{'" in shown or "['" in shown], rows


def test_the_placement_block_is_said_in_words_not_as_the_planners_data():
    rows = dict(summary_rows(SUMMARY))
    placement = {label: shown for label, shown in rows.items() if label.startswith("placement")}
    assert placement == {
        "placement": "colocated device_groups={g0: [ref_forward, actor_train]}",
        "placement.auto": "mode=separated, with_rollout=[ref_forward, reward_forward]: why",
        "placement.replan": rows["placement.replan"],
        "placement.switch at iteration 5": "separated with_rollout=[ref_forward, reward_forward] -> colocated "
                                           "device_groups={g0: [ref_forward, actor_train]} (predicted 0.5 s per "
                                           "iteration)"}
    assert rows["placement.replan"].startswith("after 5 iterations: measured 0.75 s per iteration")
    assert rows["placement.replan"].endswith("; switched: 0.64 -> 0.5 s")


def test_a_replan_that_found_nothing_better_says_it_once():
    block = {**SUMMARY["placement"], "replan": {**SUMMARY["placement"]["replan"], "better": None,
                                                "switch": {"switched": False, "why": "no faster placement"}},
             "auto": None, "switches": []}
    rows = dict(summary_rows({"placement": block}))
    assert rows["placement.auto"] == "-"
    assert rows["placement.replan"].endswith("no other placement predicted 10% faster")


def test_the_printed_table_keeps_brackets_and_whole_paths_on_a_narrow_terminal():
    console = Console(record=True, width=60)
    print_summary(SUMMARY, console)
    text = "".join(console.export_text().split())  # the table's folds and borders aside
    for border in "│┃":
        text = text.replace(border, "")
    assert "with_rollout=[ref_forward,reward_forward]" in text
    assert "runs/a-run-with-a-rather-long-name/plots/reward.png" in text
    assert "…" not in console.export_text()
