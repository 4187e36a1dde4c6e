"""The table `stream-rlhf run` prints at its end: summary.json made readable, one row per figure.

Nested mappings become dotted rows (`trace.busy.rollout`, `episodes.ended.done`), lists of plain
values one line per value, None "-", and an empty mapping or list "none". The placement block
(summary.json keeps every candidate the planner weighed) is said in the log's words: the placement
the run trained under, why auto chose it, the re-plan's verdict and each switch. summary.json
keeps everything; the table never cuts a value short (long paths fold onto the next line).
"""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from stream_rlhf.driver.placement_switch import describe_placement

Row = tuple[str, str]


def print_summary(summary: dict[str, Any], console: Console | None = None) -> None:
    table = Table(title=f"run {summary.get('name', '')}", show_header=False)
    table.add_column("figure", no_wrap=True)
    table.add_column("value", overflow="fold")
    for label, shown in summary_rows(summary):
        table.add_row(Text(label), Text(shown))  # Text: a "[...]" in a value is not rich markup
    (console or Console()).print(table)


def summary_rows(summary: dict[str, Any]) -> list[Row]:
    """Every row of the table, in summary.json's order (its `name` is the table's title)."""
    rows: list[Row] = []
    for key, value in summary.items():
        if key == "placement" and isinstance(value, dict):
            rows += _placement_rows(value)
        elif key != "name":
            rows += _rows(key, value)
    return rows


def _rows(label: str, value: Any) -> list[Row]:
    if value is None:
        return [(label, "-")]
    if isinstance(value, (dict, list)) and not value:
        return [(label, "none")]
    if isinstance(value, dict):
        return [row for key, sub in value.items() for row in _rows(f"{label}.{key}", sub)]
    if isinstance(value, list) and all(not isinstance(v, (dict, list)) for v in value):
        return [(label, "\n".join(str(v) for v in value))]
    if isinstance(value, list):
        return [row for index, sub in enumerate(value) for row in _rows(f"{label}.{index}", sub)]
    return [(label, str(value))]


def _placement_rows(block: dict[str, Any]) -> list[Row]:
    """summary.json's `placement` (driver/run.py): running, auto, replan and each switch (its `used` is
    the switches told from the other side)."""
    from stream_rlhf.planner.auto_placement import describe_replan  # the planner imports the driver's dataflow

    rows = [("placement", describe_placement(block["running"]))]
    auto = block.get("auto")
    rows.append(("placement.auto", auto["summary"].removeprefix("placement auto: ") if auto else "-"))
    replan = block.get("replan")
    if replan:
        switch = replan.get("switch")  # whether a better placement was switched to, and why (not)
        verdict = f"; {'switched' if switch['switched'] else 'kept'}: {switch['why']}" \
            if switch and replan["better"] is not None else ""
        rows.append(("placement.replan", describe_replan(replan).removeprefix("placement re-plan ") + verdict))
    for switch in block.get("switches", []):
        rows.append((f"placement.switch at iteration {switch['iteration']}",
                     f"{describe_placement(switch['from'])} -> {describe_placement(switch['to'])} "
                     f"(predicted {switch['predicted_iteration_s']} s per iteration)"))
    return rows
