"""Where the prompt source stood at the start of each iteration, so that a resumed run serves the
very prompts the interrupted one would have served next.

    cursors = PromptCursors(run_dir)
    cursors.record(iteration, dataset.cursor())   # the prompt source, before an iteration's prompts
    dataset.seek(cursors.at(iteration))           # the prompt source of a resumed run

One JSON line per iteration in `runs/<name>/checkpoints/prompt_cursor.jsonl`, appended (a torn
last line is ignored). The arithmetic task needs none (its prompts are indexed by position);
a JSONL dataset's cursor is its epoch, its place in that epoch's order and the lines it has found
bad so far (`data/prompts_jsonl.py`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from stream_rlhf.resume.store import FOLDER

FILE = "prompt_cursor.jsonl"


class PromptCursors:
    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / FOLDER / FILE

    def record(self, iteration: int, cursor: dict[str, Any]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as f:
            f.write(json.dumps({"iteration": iteration, **cursor}) + "\n")

    def at(self, iteration: int) -> dict[str, Any]:
        """The cursor recorded at the start of `iteration` (the last one, if a resumed run
        recorded it again)."""
        found = None
        if self.path.is_file():
            complete, _, _ = self.path.read_text().rpartition("\n")
            for line in complete.splitlines():
                record = json.loads(line)
                if record.pop("iteration") == iteration:
                    found = record
        if found is None:
            raise FileNotFoundError(f"{self.path}: no prompt cursor for iteration {iteration}")
        return found
