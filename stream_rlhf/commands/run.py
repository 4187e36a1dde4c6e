"""`stream-rlhf run CONFIG`: a job on this machine (or a Ray cluster), supervised to its end.

    code = cmd_run(args)        # an RL job: RLRun's prepare, the stages, finish; a dataflow config: its stages

An RL job that fails is resumed from its newest checkpoint up to `checkpoint.recoveries` times, and
one whose re-plan drained it to switch placement continues under the new placement
(`driver/placement_switch.py`). Exit codes: 0 finished, 1 a stage failed or it timed out, 2 a
config or data error (`cli.py`), 130 interrupted (Ctrl-C or SIGTERM: every stage drained first).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import signal
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path

from stream_rlhf.config import ConfigError, load_config, read_yaml
from stream_rlhf.driver.preflight import check_broker
from stream_rlhf.job import JobConfig
from stream_rlhf.launch.launcher import Launcher
from stream_rlhf.launch.local import LocalJob
from stream_rlhf.launch.spec import StageFailed

log = logging.getLogger("stream_rlhf")


def cmd_run(args: argparse.Namespace) -> int:
    if is_dataflow_config(args.config):
        if args.resume is not None:
            raise ConfigError(f"--resume: {args.config} is a dataflow config (topics and stages); only RL jobs resume")
        cfg = load_config(JobConfig, args.config, args.set)
        check_broker(cfg.broker)
        job = LocalJob(cfg.topology, cfg.broker, cfg.stages, cfg.admission())
        return supervise(job, cfg.name, cfg.timeout_s, BrokerProgress(job))
    from stream_rlhf.driver.run import RLRun
    from stream_rlhf.rl.config import RLJobConfig

    cfg = load_config(RLJobConfig, args.config, args.set)
    if args.resume:  # a run folder named on the command line: runs_dir and name follow from it
        folder = Path(args.resume).resolve()
        cfg = dataclasses.replace(cfg, runs_dir=str(folder.parent), name=folder.name)
    resume, recoveries = args.resume is not None, 0
    while True:
        run = RLRun(cfg, resume=resume)
        try:
            job = run.prepare()  # warm start and eval before: no stage process exists yet
        except KeyboardInterrupt:
            log.warning("interrupted before the stages started")
            return 130
        if job is None:  # --resume of a run whose training had ended: its eval after RL and summary
            run.finish()
            return 0
        try:
            code = supervise(job, run.cfg.name, run.cfg.timeout_s, run.progress(), watch=job.fail_on_dropped_handles)
        finally:
            run.cleanup()
        if code == 0 and (switched := run.switched(cfg)) is not None:  # the re-plan drained it to switch placement
            cfg, resume = switched, True
            continue
        if code == 0:
            run.finish()
            return 0
        point = run.latest_checkpoint()
        if code == 1 and job.failed and recoveries < cfg.checkpoint.recoveries and point is not None:
            recoveries += 1
            log.warning("recovering from the failure of %s: resuming from the newest checkpoint (recovery %d of %d)",
                        ", ".join(job.failed), recoveries, cfg.checkpoint.recoveries)
            resume = True
            continue
        run.log_resume_hint(args.config, point)
        return code


def is_dataflow_config(path: str) -> bool:
    """A config listing `topics` and `stages` itself (like broker_demo.yaml) rather than an RL job."""
    data = read_yaml(path)
    return isinstance(data, dict) and "topics" in data


def supervise(job: Launcher, name: str, timeout_s: float, progress: AbstractContextManager,
               watch: Callable[[], None] | None = None) -> int:
    """Start the job, show progress, wait for it (`watch`: see LocalJob.wait); 0 when it finished,
    1 when a stage failed or it timed out, 130 when interrupted (every stage is drained and
    stopped in all cases)."""
    signal.signal(signal.SIGTERM, _interrupt)  # `kill`, a scheduler's stop: drain as for Ctrl-C
    try:
        address = job.start()
        log.info("job %s: broker at %s, %d stage process(es)", name, address, len(job.processes))
        with progress:
            job.wait(timeout_s, watch)
    except KeyboardInterrupt:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # let the drain below finish
        log.warning("interrupted: draining every stage")
        return 130
    except (StageFailed, TimeoutError) as exc:
        log.error("job %s failed: %s", name, exc)
        return 1
    finally:
        job.stop()
    log.info("job %s finished", name)
    return 0


def _interrupt(*_) -> None:
    raise KeyboardInterrupt


class BrokerProgress:
    """One progress line every few seconds from the broker's counters (dataflow configs)."""

    def __init__(self, job: LocalJob, every_s: float = 2.0):
        self.job = job
        self.every_s = every_s
        self._stop = threading.Event()

    def __enter__(self) -> BrokerProgress:
        threading.Thread(target=self._follow, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()

    def _follow(self) -> None:
        started = time.monotonic()
        while not self._stop.wait(self.every_s):
            try:
                with self.job.client() as client:
                    s = client.stats()
            except Exception:
                continue
            queued = sum(v for k, v in s.items() if k.startswith("queue."))
            log.info(
                "[%5.1fs] published %d, delivered %d, completed %d, joins %d, queued %d, policy v%d",
                time.monotonic() - started, s.get("published", 0), s.get("delivered", 0),
                s.get("completed", 0), s.get("joins_emitted", 0), queued, s.get("policy_version", 0),
            )
