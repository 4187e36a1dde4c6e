"""The driver of `stream-rlhf run` for RL configs: everything around the stage processes.

    run = RLRun(cfg)           # RLRun(cfg, resume=True): continue from the last checkpoint (`driver/resume.py`)
    job = run.prepare()        # dataset (cached), warm start (cached), eval before, the plan -> its launcher
    ... supervise the job with run.progress() ...
    run.cleanup()              # always, however the job ended: removes the weight versions
    cfg = run.switched(cfg)    # after a clean exit: the next leg's config when the re-plan drained to switch
    summary = run.finish()     # after a finished job: eval after, summary.json + table

Sample accounting in the summary is exact: samples_generated = samples_trained + samples_dropped
(reasons in dropped_reasons) + samples_discarded_at_resume + samples_in_flight_at_stop, over every
run of a resumed job (`samples_discarded_at_resume`: generated after a checkpoint by a run that
stopped, and generated again by the run that resumed from it). Dataset lines left out under
`data.on_bad_sample: skip` are reported as lines_skipped (train and eval, by reason) with the
first messages in lines_skipped_examples.
A vision-language run adds images_seen (images in the generated samples) and images_encoded
(vision tower runs over images, summed over every stage that ran it).
`placement`: the placement the job ran (`running`), what `placement: auto` chose and why (`auto`,
null when every key was given), the re-plan after the first iterations (`replan`,
`driver/replan.py`; null when it did not run; with its decision under `replan.switch`), the
placements trained under with the iteration each began at (`used`) and the switches between them
(`switches`: iteration, from, to, predicted seconds per iteration; `driver/placement_switch.py`).
After a switch, `auto` and `replan` are the first placement's.
`memory`: the peak memory of the job's processes (the broker and every rank process), sampled
while they ran (`telemetry/memory.py`); local launcher only (a Ray job's actors are Ray's to
measure: `memory` is null there).
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stream_rlhf.config import ConfigError
from stream_rlhf.driver.dataflow import ROLLOUT_SIDE, check_placement
from stream_rlhf.driver.placement_switch import placements_used, switched_config
from stream_rlhf.driver.plan import auto_placed, compile_plan
from stream_rlhf.driver.preflight import check_rl_job
from stream_rlhf.driver.replan import ReplanWatch
from stream_rlhf.driver.resume import Resumed, prepare_resume, read_record, read_switches, record_start
from stream_rlhf.driver.summary_table import print_summary
from stream_rlhf.launch.launcher import Launcher, make_launcher
from stream_rlhf.launch.plan import JobPlan
from stream_rlhf.models.lora_config import LoRAConfig
from stream_rlhf.resume.store import ResumePoint
from stream_rlhf.rl.config import RLJobConfig
from stream_rlhf.rl.reward_parts_config import policy_version_at
from stream_rlhf.stages.trainer_checkpoint import checkpoint_parts, checkpoint_store
from stream_rlhf.telemetry.episodes import episode_summary
from stream_rlhf.telemetry.memory import MemorySampler, describe, device_peaks
from stream_rlhf.telemetry.metrics import MetricsWriter, read_metrics
from stream_rlhf.telemetry.progress import IterationProgress
from stream_rlhf.telemetry.stage_counts import read_stage_counts, read_stage_details
from stream_rlhf.telemetry.trace import FOLDER as TRACE_FOLDER
from stream_rlhf.telemetry.trace_figures import TraceFigures, iteration_figures, trace_figures
from stream_rlhf.telemetry.trace_merge import merge_trace, topic_sources
from stream_rlhf.weights.device_turns import offload_summary
from stream_rlhf.weights.shm_store import weights_root

if TYPE_CHECKING:
    from stream_rlhf.planner.auto_placement import PlacementChoice

log = logging.getLogger("stream_rlhf")
TRACE_METRICS = "trace_metrics.jsonl"
"""Per trained iteration, the trace's figures over that iteration (also TensorBoard's `trace/` tags)."""
PLAN = "plan.json"
"""The job plan as `stream-rlhf plan --json` prints it (`launch/plan.py`), written before the stages start."""
RUN_OUTPUTS = ("metrics.jsonl", "critic_metrics.jsonl", TRACE_METRICS, "train_summary.json", "summary.json",
               TRACE_FOLDER, "stage_counts", "checkpoint", "checkpoints", "tensorboard", "samples.jsonl", "plots",
               "view.html", PLAN)
"""What a run writes in runs/<name>/; a new run of the same name starts without them."""
RESUME_KEEPS = ("metrics.jsonl", "critic_metrics.jsonl", TRACE_METRICS, "stage_counts", "checkpoints", "tensorboard",
                "samples.jsonl")
"""What a resumed run continues (the metrics cut back to its checkpoint) instead of deleting."""
TRACE = "trace.json"
"""The run's trace (`telemetry/trace_merge.py`), merged from TRACE_FOLDER's per-process files
however the job ended; a resumed run starts a new one."""


class RLRun:
    def __init__(self, cfg: RLJobConfig, resume: bool = False):
        self.cfg = cfg
        self.resume = resume
        self.resumed: Resumed | None = None
        self.run_dir = Path(cfg.run_dir)
        self.weights = weights_root(cfg.broker.shm_prefix, cfg.name)
        self.started = time.monotonic()
        self.job_started = self.started
        self.before: dict[str, float] = {}
        self.checkpoint = ""
        self.vision_language = False
        self.left_out: dict[str, str] = {}
        """Stages the dataflow leaves out, with the reason (`rl/dataflow.left_out_stages`)."""
        self.plan: JobPlan | None = None
        """The job plan, compiled once by `prepare` (after the dataset and the warm start)."""
        self.job: Launcher | None = None
        self.trace_figures: TraceFigures | None = None
        """From trace.json, once `cleanup` merged it (None: no trace, or no steady-state window)."""
        self.memory: MemorySampler | None = None
        """The job's processes' memory, sampled during `progress` (local launcher only)."""
        self.placement_choice: PlacementChoice | None = None
        """What `placement: auto` chose (`prepare`); None: every placement key was given."""
        self.replan: ReplanWatch | None = None
        """The re-plan after the first iterations (`progress`), when auto predicted the placement."""

    def prepare(self) -> Launcher | None:
        """Everything before the stages start, and the launcher that starts them; None for a resumed
        run whose training had ended (a stop during its last moments or its eval after RL): `finish`
        is all it has left, and nothing of the stopped run is deleted."""
        from stream_rlhf.driver.device_child import on_job_device
        from stream_rlhf.driver.evaluate import evaluate
        from stream_rlhf.driver.warm_start import warm_start_off_driver
        from stream_rlhf.models.checkpoint import is_vision_language
        from stream_rlhf.rl.task_data import resolve_data

        check_rl_job(self.cfg)  # paths, keys and addresses the config names, before anything starts
        check_placement(self.cfg)  # cores and devices of this machine, before anything costly
        if self.cfg.rollout.backend == "vllm":
            from stream_rlhf.backends.vllm_client import check_engine_python

            check_engine_python(self.cfg.rollout.vllm.python)
        ended = self.resume and self.training_ended()
        for name in RUN_OUTPUTS:
            path = self.run_dir / name
            if not (self.resume and name in RESUME_KEEPS) and not ended:
                shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(self.weights, ignore_errors=True)
        self.cfg = resolve_data(self.cfg)
        record = read_record(self.run_dir) if ended else None
        if ended:
            log.info("--resume: the training had ended (all %d iterations, %s): what is left is the eval after RL "
                     "and summary.json", self.cfg.iterations, self.run_dir / "checkpoint")
        elif self.resume:
            self.resumed = prepare_resume(self.run_dir, self.cfg, self.weights)
        started_from = self.resumed.start_checkpoint if self.resumed else record["start_checkpoint"] if record else None
        if started_from and Path(started_from).is_dir():
            self.checkpoint = started_from
        else:
            self.checkpoint = str(warm_start_off_driver(self.cfg))
        self.vision_language = is_vision_language(self.checkpoint)
        if self.vision_language and self.cfg.reward.model_path is not None:
            raise ConfigError(f"reward.model_path={self.cfg.reward.model_path!r}: reward models are text-only, "
                              "and this is a vision-language run")
        if self.cfg.algorithm.uses_critic and self.cfg.critic.init == "reward_model":
            from stream_rlhf.models.checkpoint import architecture_differences

            if differences := architecture_differences(self.cfg.reward.model_path, self.checkpoint):
                raise ConfigError(f"critic.init=reward_model: reward.model_path={self.cfg.reward.model_path!r} is not "
                                  f"the policy's architecture ({'; '.join(differences)})")
        if self.vision_language and self.cfg.rollout.backend == "vllm" and self.cfg.weights.update == "in_flight":
            raise ConfigError("weights.update=in_flight: not with images on the vLLM backend (its encoder cache is "
                              "reset at each update, which requests in flight still use); use drain")
        if self.resumed is None and record is None:
            self.before = on_job_device(self.cfg, "eval", evaluate, self.cfg, self.checkpoint)
            record_start(self.run_dir, self.cfg, self.before, self.checkpoint)
        else:
            self.before = self.resumed.eval_before if self.resumed else record["eval_before"]
        log.info("eval before RL: reward %.3f (greedy %.3f)", self.before["reward"], self.before["greedy_reward"])
        self.cfg, self.placement_choice = auto_placed(self.cfg, self.checkpoint, str(self.weights),
                                                      self.vision_language)
        choice = self.placement_choice  # the job plan's "placement auto" line says what it chose and why
        self.plan = compile_plan(self.cfg, self.checkpoint, str(self.weights), self.vision_language,
                                 self.resumed.point if self.resumed else None,
                                 placement_auto=choice.as_dict() if choice is not None else None)
        self.left_out = self.plan.flow.left_out
        log.info("job plan:\n%s", self.plan.describe())
        self.job_started = time.monotonic()
        if ended:
            self._figures_of_trace()
            return None
        (self.run_dir / PLAN).write_text(json.dumps(self.plan.as_dict(), indent=2))
        self.job = make_launcher(self.plan)
        return self.job

    def training_ended(self) -> bool:
        """The run's training finished (train_summary.json, and a checkpoint of every iteration)."""
        point = self.latest_checkpoint() if (self.run_dir / "train_summary.json").is_file() else None
        return point is not None and point.version >= self.cfg.iterations

    def _figures_of_trace(self) -> None:
        """The trace's figures from the trace.json the stopped run merged (when it has one)."""
        path = self.run_dir / TRACE
        if self.cfg.trace and path.is_file():
            self.trace_figures = trace_figures(json.loads(path.read_text())["traceEvents"], ROLLOUT_SIDE)

    @contextmanager
    def progress(self) -> Iterator[None]:
        """While the job runs (its processes started): the progress bar, and memory sampling."""
        from stream_rlhf.launch.local import LocalJob

        if isinstance(self.job, LocalJob):
            self.memory = MemorySampler(self.job.pids)
            self.memory.start()
        choice = self.placement_choice
        metrics = self.run_dir / "metrics.jsonl"
        if choice is not None and choice.predicted_iteration_s is not None and self.cfg.placement.replan_after:
            self.replan = ReplanWatch(self.cfg, self.plan.flow, choice, metrics,
                                      may_switch=not read_switches(self.run_dir), on_switch=self.job.ask_shutdown)
        try:
            with IterationProgress(metrics, self.cfg.iterations), self.replan or nullcontext():
                yield
        finally:
            if self.memory is not None:
                self.memory.stop()

    def cleanup(self) -> None:
        shutil.rmtree(self.weights, ignore_errors=True)
        if self.plan is not None and self.plan.flow.trace_folder is not None:
            self._merge_trace(self.plan)

    def _merge_trace(self, plan: JobPlan) -> None:
        """trace.json from every process's events, and the figures from it (after a failure too)."""
        flow = plan.flow
        try:
            merged = merge_trace(Path(flow.trace_folder), self.run_dir / TRACE, topic_sources(flow.topology),
                                 list(flow.stages), read_metrics(self.run_dir / "metrics.jsonl"))
        except OSError as exc:  # a full disk must not hide how the job ended
            log.warning("could not write %s: %s", self.run_dir / TRACE, exc)
            return
        if merged.lines_skipped:
            log.warning("%s: %d unreadable trace line(s) skipped (a process stopped mid-write)",
                        self.run_dir / TRACE, merged.lines_skipped)
        log.info("trace of %d events in %s (open it in https://ui.perfetto.dev)", len(merged.events),
                 self.run_dir / TRACE)
        self.trace_figures = trace_figures(merged.events, ROLLOUT_SIDE)
        writer = MetricsWriter(self.run_dir, "trace", TRACE_METRICS, purge_step=self.resumed.point.version
                               if self.resumed else 0)
        for iteration, figures in sorted(iteration_figures(merged.events, ROLLOUT_SIDE).items()):
            writer.write(figures.record(iteration))

    def switched(self, cfg: RLJobConfig) -> RLJobConfig | None:
        """After the job exited cleanly: when the re-plan drained it to switch placement, `cfg`
        (the config as loaded) with the new placement, for a run that resumes from the drain's
        checkpoint; None when no switch was asked for, or the job finished every iteration first."""
        switch = self.replan.switch if self.replan is not None else None
        if switch is None:
            return None
        if (self.run_dir / "train_summary.json").is_file():
            log.info("placement: the job finished before the switch to %s", switch.to_placement)
            return None
        return switched_config(cfg, self.run_dir, switch, self.latest_checkpoint())

    def latest_checkpoint(self) -> ResumePoint | None:
        """The complete, intact checkpoint a resumed run would continue from (every file's checksum
        is read: call it once per decision)."""
        return checkpoint_store(self.run_dir, self.cfg).latest(checkpoint_parts(self.cfg))

    def log_resume_hint(self, config: str, point: ResumePoint | None) -> None:
        """After a run that did not finish: how to continue it from `point`, if it left one (a
        stop in the last moments may come after the training ended: then nothing is left to train)."""
        if point is not None and point.version >= self.cfg.iterations:
            log.info("the training had ended: checkpoint %s holds all %d iterations (the final weights), and the "
                     "run stopped before its eval after RL and summary.json: `stream-rlhf run %s --resume %s` "
                     "makes them", point.folder, point.version, config, self.run_dir)
        elif point is not None:
            log.info("checkpoint %s holds iteration %d (policy version %d): continue with `stream-rlhf run %s "
                     "--resume %s`", point.folder, point.version,
                     policy_version_at(point.version, self.cfg.critic.warmup_iterations), config, self.run_dir)

    def finish(self) -> dict[str, Any]:
        from stream_rlhf.driver.device_child import on_job_device
        from stream_rlhf.driver.evaluate import evaluate
        from stream_rlhf.telemetry.plots import write_plots

        job_s = time.monotonic() - self.job_started
        after = on_job_device(self.cfg, "eval", evaluate, self.cfg, str(self.run_dir / "checkpoint"))
        train = json.loads((self.run_dir / "train_summary.json").read_text())
        records = read_metrics(self.run_dir / "metrics.jsonl")
        steady = records[1:] or records  # the first iteration also pays for process start-up
        counts = read_stage_counts(self.run_dir)
        skipped, skipped_examples = _skipped(self.run_dir)
        generated = counts.get("rollout", {}).get("generated", 0)
        discarded = sum(r["discarded"] for r in read_record(self.run_dir)["resumes"])  # over every resume
        summary = {
            "name": self.cfg.name,
            "algorithm": self.cfg.algorithm.advantage,
            "schedule": self.cfg.schedule,
            "overlap_depth": self.cfg.overlap_depth,
            "stages_left_out": self.left_out,
            "eval_reward_before": self.before["reward"],
            "eval_reward_after": after["reward"],
            "eval_greedy_reward_before": self.before["greedy_reward"],
            "eval_greedy_reward_after": after["greedy_reward"],
            "iterations": train["iterations"],
            "tokens_per_s": round(sum(r.get("tokens", 0) for r in steady)
                                  / max(sum(r["iteration_s"] for r in steady), 1e-9), 1),
            "iteration_s": round(sum(r["iteration_s"] for r in steady) / max(len(steady), 1), 3),
            "samples_generated": generated,
            "samples_trained": train["samples_trained"],
            "samples_critic_warmup": train["samples_critic_warmup"],
            "samples_dropped": train["samples_dropped"],
            "dropped_reasons": train["dropped_reasons"],
            "samples_replayed_at_resume": counts.get("rollout", {}).get("replayed", 0),
            "samples_discarded_at_resume": discarded,
            "samples_in_flight_at_stop": generated - train["samples_trained"] - train["samples_dropped"] - discarded,
            "max_staleness": train["max_staleness"],
            "lines_skipped": {"train": skipped, "eval": after["skipped"]},
            "lines_skipped_examples": skipped_examples + after["skipped_examples"],
            "job_s": round(job_s, 1),
            "wall_s": round(time.monotonic() - self.started, 1),
            "start_checkpoint": self.checkpoint,
            "checkpoint": str(self.run_dir / "checkpoint"),
            "resumed_from": [r["version"] for r in read_record(self.run_dir)["resumes"]],
        }
        if self.cfg.trace:
            summary["trace"] = self.trace_figures.summary() if self.trace_figures else None
        evals = {"eval": "reward", "eval greedy": "greedy_reward"}
        summary["plots"] = [str(path) for path in write_plots(self.run_dir, {
            label: {0: self.before[key], train["iterations"]: after[key]} for label, key in evals.items()})]
        placement = self.cfg.placement
        running = {"mode": placement.mode, "with_rollout": placement.with_rollout,
                   "device_groups": self.plan.flow.device_groups}
        switches = read_switches(self.run_dir)
        first = switches[0] if switches else {}
        summary["placement"] = {
            "running": running,
            "auto": first["auto"] if first else self.placement_choice.as_dict() if self.placement_choice else None,
            "replan": first["replan"] if first else self.replan.result if self.replan else None,
            "used": placements_used(running, switches),
            "switches": [{k: s[k] for k in ("iteration", "from", "to", "predicted_iteration_s")} for s in switches]}
        summary["actor_parameters"] = _parameters(self.run_dir, "actor_train", self.cfg.actor.lora)
        if self.cfg.algorithm.uses_critic:
            summary["critic_parameters"] = _parameters(self.run_dir, "critic_train", self.cfg.critic.lora)
        summary["offload"] = offload_summary(counts, {n: s.offload for n, s in self.plan.flow.stages.items()})
        memory = self.memory.summary(device_peaks(self.run_dir, self.plan.flow.stages)) if self.memory else None
        summary["memory"] = memory
        if memory is not None:
            log.info("memory: %s", describe(memory))
        if self.cfg.reward.workers:  # calls of the reward function past reward.timeout_s
            summary["reward_timeouts"] = int(counts.get("reward_forward", {}).get("reward_timeouts", 0))
        if self.vision_language:
            summary["images_seen"] = counts.get("prompts", {}).get("images_seen", 0)
            summary["images_encoded"] = sum(c.get("images_encoded", 0) for c in counts.values())
            summary["images_encoded_by_stage"] = {s: c["images_encoded"] for s, c in counts.items()
                                                  if "images_encoded" in c}
        if self.cfg.env is not None:
            summary.update(episode_summary(counts.get("rollout", {})))  # episodes block, episodes_failed
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        print_summary({**summary, "memory": describe(memory) if memory else None})  # one row, not one a process
        return summary


def _parameters(run_dir: Path, stage: str, lora: LoRAConfig | None) -> dict[str, Any] | None:
    """The trainer's model's parameters, those it trains (all but a frozen vision tower, or the
    LoRA adapters and a critic's head) and their share, from its stage details; None if it never
    got that far."""
    found = [d for d in read_stage_details(run_dir, stage) if "parameters" in d]
    if not found:
        return None
    trained, total = found[-1]["parameters_trained"], found[-1]["parameters"]
    adapters = None if lora is None else f"rank {lora.rank}, alpha {lora.alpha:g} on {', '.join(lora.target_modules)}"
    return {"total": total, "trained": trained, "trained_share": round(trained / max(total, 1), 4), "lora": adapters}


def _skipped(run_dir: Path) -> tuple[dict[str, int], list[str]]:
    """Train lines the prompt source skipped, by reason, and the first messages ("file:line: why")."""
    total: dict[str, int] = {}
    examples: list[str] = []
    for details in read_stage_details(run_dir, "prompts"):
        for reason, count in details.get("skipped", {}).items():
            total[reason] = total.get(reason, 0) + count
        examples += details.get("skipped_examples", [])
    return total, examples
