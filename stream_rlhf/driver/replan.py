"""Re-planning while the job runs: has the workload drifted from what `placement: auto` costed?

    with ReplanWatch(cfg, flow, choice, run_dir / "metrics.jsonl", may_switch, job.ask_shutdown):  # RLRun.progress
        ...                                                            # the job runs
    watch.result     # planner/auto_placement.py `replan`'s figures and the decision, or None (too few iterations)
    watch.switch     # the switch it asked for (`placement_switch.py`), or None

Once `placement.replan_after` iterations are in metrics.jsonl (a critic warm-up's not counted: the
actor trains nothing in them), the watch (a thread of the driver) takes their mean iteration time
and answer length (`response_len`; the first iteration, which pays for the processes' start-up,
left out when there are others) and predicts every placement auto could have chosen again at
that answer length, on the figures of the first choice (nothing is timed during the run). When
another is predicted faster than the running one by `placement.replan_margin`, it logs a warning
naming the `--set` lines; summary.json keeps the figures either way (`placement.replan`). Under
`placement.replan: switch` it may also switch (`placement_switch.py` decide): it then asks every
stage to drain (`on_switch`), and the driver resumes the job from the checkpoint the drain
leaves, with the new placement.

Tests force the decision with the environment variable `STREAM_RLHF_REPLAN_FORCE_SWITCH=1`: the
fastest placement other than the running one counts as better whatever the margin, and a switch
is made whatever the predicted gain (the other conditions hold).
"""

from __future__ import annotations

import logging
import os
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stream_rlhf.driver.placement_switch import PlannedSwitch, decide, planned_switch, restart_estimate
from stream_rlhf.launch.plan import Dataflow
from stream_rlhf.rl.config import RLJobConfig
from stream_rlhf.telemetry.metrics import read_metrics

if TYPE_CHECKING:
    from stream_rlhf.planner.auto_placement import PlacementChoice

log = logging.getLogger("stream_rlhf")
FORCE_SWITCH_VARIABLE = "STREAM_RLHF_REPLAN_FORCE_SWITCH"


class ReplanWatch:
    def __init__(self, cfg: RLJobConfig, flow: Dataflow, choice: PlacementChoice, metrics_path: Path | None,
                 may_switch: bool = False, on_switch: Callable[[], None] | None = None, every_s: float = 0.25):
        self.cfg, self.flow, self.choice = cfg, flow, choice
        self.path = metrics_path
        self.may_switch = may_switch
        """False: the run switched placement already (`placement_switch.MAX_SWITCHES`)."""
        self.on_switch = on_switch
        """Called once a switch is decided: drain every stage (the launcher's `ask_shutdown`)."""
        self.every_s = every_s
        self.result: dict[str, Any] | None = None
        self.switch: PlannedSwitch | None = None
        self.first_record_s: float | None = None
        """Seconds from the watch's start (the processes') to the first record it saw: the job's start-up."""
        self._started = time.monotonic()
        self._records_before = 0
        """Records metrics.jsonl held when the watch started (a resumed run's, up to its checkpoint)."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._follow, daemon=True)

    def __enter__(self) -> ReplanWatch:
        self._started = time.monotonic()
        self._records_before = len(read_metrics(self.path))
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
            if len(records) > self._records_before and self.first_record_s is None:
                self.first_record_s = time.monotonic() - self._started
            trained = [r for r in records if "critic_warmup" not in r]  # a critic warm-up's train no actor
            if len(trained) >= after:
                self.check(trained[:after], done=len(records) if not stopping else self.cfg.iterations)
                return
            if stopping:
                return

    def check(self, records: list[dict[str, Any]], done: int) -> None:
        """Re-plan from `records` (metrics.jsonl's first iterations; `done` iterations trained so
        far), say what it found, and switch when `decide` says so."""
        from stream_rlhf.planner.auto_placement import describe_replan, replan

        measured = records[1:] or records
        forced = os.environ.get(FORCE_SWITCH_VARIABLE) == "1"
        self.result = replan(self.cfg, self.flow, self.choice,
                             statistics.fmean(r["response_len"] for r in measured),
                             statistics.fmean(r["iteration_s"] for r in measured), len(records), force=forced)
        decision = decide(self.cfg, self.result, done, restart_estimate(records, self.first_record_s),
                          not self.may_switch, forced)
        self.result["switch"] = {"switched": decision.switch, "why": decision.why}
        text = describe_replan(self.result)
        if self.result["better"] is None:
            log.info(text)
            return
        if not decision.switch:
            log.warning("%s; not switched: %s", text, decision.why)
            return
        self.switch = planned_switch(self.choice, self.result)
        log.warning("%s; %s: draining the stages, to resume from the checkpoint they leave (%s)", text,
                    self.switch.describe(), decision.why)
        if self.on_switch is not None:
            self.on_switch()
