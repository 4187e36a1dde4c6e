"""What the user watches during `stream-rlhf run`: a progress bar over iterations with reward,
KL, tokens/s and staleness, the turns of a multi-turn job and the groups dynamic sampling trained
(a log line per iteration when stderr is not a terminal). The summary
table at the end is `driver/summary_table.py`.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from stream_rlhf.telemetry.metrics import read_metrics

log = logging.getLogger("stream_rlhf")


def describe(record: dict[str, Any]) -> str:
    line = (f"reward {record.get('reward', float('nan')):.3f}  kl {record.get('kl', float('nan')):.4f}  "
            f"{record.get('tokens_per_s', 0):.0f} tok/s  staleness {record.get('staleness_mean', 0):.2f}"
            f"/{record.get('staleness_max', 0)}")
    if "turns_per_episode" in record:  # a multi-turn job (env:)
        line += f"  {record['turns_per_episode']:.2f} turns/ep  tool hidden {record['tool_hidden_frac']:.0%}"
    if "groups_trained" in record:  # algorithm.dynamic_sampling
        line += f"  {record['groups_trained']} groups trained ({record['groups_uniform_frac']:.0%} alike left out)"
    return line


class IterationProgress:
    """Follows runs/<name>/metrics.jsonl (written by actor_train) from a background thread."""

    def __init__(self, metrics_path: Path, iterations: int, every_s: float = 0.5):
        self.path = metrics_path
        self.iterations = iterations
        self.every_s = every_s
        self.console = Console(stderr=True)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._follow, daemon=True)

    def __enter__(self) -> IterationProgress:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _follow(self) -> None:
        shown = 0
        bar = Progress(TextColumn("iteration"), MofNCompleteColumn(), BarColumn(), TimeElapsedColumn(),
                       TextColumn("{task.description}"), console=self.console, disable=not self.console.is_terminal)
        with bar:
            task = bar.add_task("starting stages", total=self.iterations)
            while True:
                stopping = self._stop.wait(self.every_s)
                records = read_metrics(self.path)
                for record in records[shown:]:
                    bar.update(task, completed=record["iteration"] + 1, description=describe(record))
                    if not self.console.is_terminal:
                        log.info("iteration %d/%d: %s", record["iteration"] + 1, self.iterations, describe(record))
                shown = len(records)
                if stopping:
                    return
