"""Counters a stage keeps on disk for the run summary: samples generated, images encoded, lines
skipped, seconds spent in tool calls (a count may be a float). One JSON file per process,
rewritten after every step, so a crashed and restarted instance adds to the total instead of
losing it.

    counts = StageCounts(run_dir, "rollout", ctx.instance_id)
    counts.add(generated=64, images=64)
    read_stage_counts(run_dir)  -> {"rollout": {"generated": 10240, "images": 10240}, ...}
"""

from __future__ import annotations

import json
import os
from pathlib import Path

FOLDER = "stage_counts"


class StageCounts:
    def __init__(self, run_dir: Path, stage: str, instance_id: str, write: bool = True):
        """`write=False`: counted in memory only (a rank group's followers, whose leader counts
        the same samples)."""
        self.stage = stage
        self.write = write
        self.values: dict[str, int | float] = {}
        self.details: dict[str, object] = {}
        self.file = Path(run_dir) / FOLDER / f"{instance_id}-{os.getpid()}.json"
        if write:
            self.file.parent.mkdir(parents=True, exist_ok=True)

    def add(self, **counts: int | float) -> None:
        for key, value in counts.items():
            self.values[key] = self.values.get(key, 0) + value
        self._write()

    def set_details(self, **details: object) -> None:
        """JSON values reported as they are (e.g. the reasons of skipped lines)."""
        self.details.update(details)
        self._write()

    def _write(self) -> None:
        if not self.write:
            return
        partial = self.file.with_suffix(".partial")
        partial.write_text(json.dumps({"stage": self.stage, "counts": self.values, "details": self.details}))
        partial.replace(self.file)  # a reader never sees half a file


def read_stage_counts(run_dir: Path) -> dict[str, dict[str, int | float]]:
    """Counts summed over every process of each stage."""
    totals: dict[str, dict[str, int | float]] = {}
    for path in sorted((Path(run_dir) / FOLDER).glob("*.json")):
        record = json.loads(path.read_text())
        stage = totals.setdefault(record["stage"], {})
        for key, value in record["counts"].items():
            stage[key] = stage.get(key, 0) + value
    return totals


def read_stage_details(run_dir: Path, stage: str) -> list[dict[str, object]]:
    """The details of every process of `stage`."""
    records = [json.loads(p.read_text()) for p in sorted((Path(run_dir) / FOLDER).glob("*.json"))]
    return [r["details"] for r in records if r["stage"] == stage]
