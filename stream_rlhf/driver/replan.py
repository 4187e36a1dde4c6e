"""Re-planning while the job runs: has the workload drifted from what `placement: auto` costed?

    with ReplanWatch(cfg, flow, choice, run_dir / "metrics.jsonl"):   # RLRun.progress
        ...                                                            # the job runs
    watch.result     # planner/auto_placement.py `replan`'s figures, or None (too few iterations)

Once `placement.replan_after` iterations are in metrics.jsonl, the watch (a thread of the driver)
takes their mean iteration time and answer length (`response_len`; the first iteration, which
pays for the processes' start-up, left out when there are others) and predicts every placement
auto could have chosen again at that answer length, on the figures of the first choice (nothing
is timed during the run). When another is predicted faster than the running one by
`placement.replan_margin`, it logs a warning naming the `--set` lines; summary.json keeps the
figures either way (`placement.replan`). The running job keeps its placement: switching at a
checkpoint boundary is not built (a run resumed from the checkpoint chooses again).
"""

from __future__ import annotations

import logging
import statistics
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stream_rlhf.launch.plan import Dataflow
from stream_rlhf.rl.config import RLJobConfig
from stream_rlhf.telemetry.metrics import read_metrics

if TYPE_CHECKING:
    from stream_rlhf.planner.auto_placement import PlacementChoice

log = logging.getLogger("stream_rlhf")


class ReplanWatch:
    def __init__(self, cfg: RLJobConfig, flow: Dataflow, choice: PlacementChoice, metrics_path: Path,
                 every_s: float = 1.0):
        self.cfg, self.flow, self.choice = cfg, flow, choice
        self.path = metrics_path
        self.every_s = every_s
        self.result: dict[str, Any] | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._follow, daemon=True)

    def __enter__(self) -> ReplanWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _follow(self) -> None:
        after = self.cfg.placement.replan_after
        while True:
            stopping = self._stop.wait(self.every_s)
            records = read_metrics(self.path)  # once more after the job ended: a short run's last lines
            if len(records) >= after:
                self.check(records[:after])
                return
            if stopping:
                return

    def check(self, records: list[dict[str, Any]]) -> None:
        """Re-plan from `records` (metrics.jsonl's first iterations) and say what it found."""
        from stream_rlhf.planner.auto_placement import describe_replan, replan

        measured = records[1:] or records
        self.result = replan(self.cfg, self.flow, self.choice,
                             statistics.fmean(r["response_len"] for r in measured),
                             statistics.fmean(r["iteration_s"] for r in measured), len(records))
        text = describe_replan(self.result)
        if self.result["better"]:
            log.warning(text)
        else:
            log.info(text)
