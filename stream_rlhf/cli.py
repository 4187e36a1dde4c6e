"""The `stream-rlhf` command.

    stream-rlhf run CONFIG [--set key=value ...]   broker + every stage as local processes
                           [--resume [RUN_DIR]]    ... continuing a stopped run from its last checkpoint
    stream-rlhf plan CONFIG [--json]               the job plan: which stage on which node, cores, device,
                                                   and what `placement: auto` chose, why (planner/)
                    [--profile RUN_DIR [--search]] ... its predicted iteration time and memory from a run,
                    [--memory-limit-mb N]          and the fastest schedules, placements and device groups
                                                   predicted within N MB (planner/)
                    [--search | --device NAME,...] ... without --profile: from analytic costs, on this
                                                   machine (timed once) or on a preset device
    stream-rlhf broker CONFIG                      only the broker (stages started elsewhere; an RL job's
                                                   dataset and warm start are made here, once)
    stream-rlhf stage CONFIG STAGE --broker ADDR [--index N] [--rank R --group tcp://HOST:PORT] [--set key=value]
                                                   one instance, or one rank of it (SLURM, k8s; see
                                                   launch/by_hand.py); it never warm-starts
    stream-rlhf stats ADDR                         the broker's counters
    stream-rlhf keys DIR                           CURVE keys for a broker bound beyond loopback
    stream-rlhf view RUN_DIR [--serve [--port P]]  RUN_DIR/view.html: the logged samples, token by token
    stream-rlhf episodes CONFIG [--count N]        an env job's first N eval episodes, played with its
                    [--checkpoint DIR] [--greedy]  policy and printed turn by turn (driver/try_episodes.py)
    stream-rlhf init-model CONFIG FOLDER           a random-initialised model of CONFIG's model.tiny
                                                   (e.g. --set model.tiny.architecture=qwen3: Qwen3-VL)
                                                   with the project's tokenizer: a folder for model.path
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import signal
import sys
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING

from stream_rlhf.config import ConfigError, load_config, read_yaml
from stream_rlhf.data.errors import DataError
from stream_rlhf.driver.preflight import check_broker, check_rl_job
from stream_rlhf.job import JobConfig
from stream_rlhf.launch.launcher import Launcher
from stream_rlhf.launch.local import LocalJob
from stream_rlhf.launch.plan import Dataflow, JobPlan
from stream_rlhf.launch.process_start import start_fork_server
from stream_rlhf.launch.spec import StageFailed, setup_logging

if TYPE_CHECKING:
    from stream_rlhf.rl.config import RLJobConfig

log = logging.getLogger("stream_rlhf")
CONFIG_REFERENCE = ("Every config key, with its type, default, constraint and description: docs/config.md "
                    "(generated from the config classes by python -m stream_rlhf.config_reference).")
"""The epilog of `stream-rlhf run --help`."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="stream-rlhf", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a job on this machine", epilog=CONFIG_REFERENCE)
    run.add_argument("config", help="the job's YAML file, e.g. configs/text_ppo.yaml")
    run.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                     help="override a config key, e.g. --set algorithm.kl.coef=0.05 (repeatable)")
    run.add_argument("--resume", nargs="?", const="", default=None, metavar="RUN_DIR",
                     help="continue the run in RUN_DIR (default runs/<name>) from its last complete checkpoint")
    plan = sub.add_parser("plan", help="print the job plan (nothing starts)")
    plan.add_argument("config")
    plan.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    plan.add_argument("--json", action="store_true", help="also print the plan as one JSON object, the last line")
    plan.add_argument("--profile", type=Path, metavar="RUN_DIR",
                      help="predict the run from the trace of a finished run of this job (planner/)")
    plan.add_argument("--search", action="store_true", help="the fastest schedules and placements (costs: --profile's "
                      "run, else analytic)")
    plan.add_argument("--device", metavar="NAME[,KEY=VALUE...]", help="analytic costs on a preset device, e.g. "
                      "h100,count=8 (planner/devices.py; default: this machine, timed)")
    plan.add_argument("--prompt-tokens", type=float, help="analytic costs: mean prompt tokens (default: the "
                      "arithmetic task's)")
    plan.add_argument("--response-tokens", type=float, help="analytic costs: decode steps per mini-batch "
                      "(default: rollout.max_new_tokens)")
    plan.add_argument("--top", type=int, default=3, help="plans --search prints (default 3)")
    plan.add_argument("--memory-limit-mb", type=float, metavar="N",
                      help="with --search: leave out plans whose predicted host memory is over N MB")
    broker = sub.add_parser("broker", help="run only the broker of a job")
    broker.add_argument("config")
    broker.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    stage = sub.add_parser("stage", help="run one stage instance of a job")
    stage.add_argument("config")
    stage.add_argument("stage")
    stage.add_argument("--broker", required=True, help="broker address, e.g. tcp://10.0.0.1:5555")
    stage.add_argument("--index", type=int, default=0)
    stage.add_argument("--rank", type=int, default=0, help="this process's rank, for a stage of several ranks")
    stage.add_argument("--group", default=None, metavar="URL",
                       help="the ranks' rendezvous (tcp://HOST:PORT, where rank 0 listens; or file:///PATH)")
    stage.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    stats = sub.add_parser("stats", help="print a running broker's counters")
    stats.add_argument("address")
    stats.add_argument("--keys", default=None, help="CURVE key folder")
    keys = sub.add_parser("keys", help="write CURVE keys into DIR")
    keys.add_argument("dir")
    view = sub.add_parser("view", help="write RUN_DIR/view.html, a page of the run's logged samples")
    view.add_argument("run_dir")
    view.add_argument("--serve", action="store_true", help="then serve RUN_DIR on 127.0.0.1 until Ctrl-C")
    view.add_argument("--port", type=int, default=None, help="with --serve: the port (default 8765; 0: any free one)")
    episodes = sub.add_parser("episodes", help="play an env job's first eval episodes and print them turn by turn")
    episodes.add_argument("config")
    episodes.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    episodes.add_argument("--count", type=int, default=4, help="episodes (default 4)")
    episodes.add_argument("--checkpoint", help="the policy (default: the job's start: model.path or the warm start)")
    episodes.add_argument("--greedy", action="store_true", help="greedy turns (default: rollout.temperature)")
    episodes.add_argument("--json", action="store_true", help="also print them as one JSON object, the last line")
    init = sub.add_parser("init-model", help="write a random-initialised model of CONFIG's model.tiny into FOLDER")
    init.add_argument("config", help="a job's YAML file: its model.tiny and model.seed are read")
    init.add_argument("folder", help="where the checkpoint goes (a folder model.path takes); must not exist")
    init.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                      help="override a config key, e.g. --set model.tiny.architecture=qwen3 (repeatable)")
    args = parser.parse_args(argv)
    setup_logging()
    try:
        return COMMANDS[args.command](args)
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    except DataError as exc:
        print(f"data error: {exc}", file=sys.stderr)
        return 2


def cmd_run(args: argparse.Namespace) -> int:
    if _launches_locally(args):
        start_fork_server()  # its imports run beside this process's own from here on
    if is_dataflow_config(args.config):
        if args.resume is not None:
            raise ConfigError(f"--resume: {args.config} is a dataflow config (topics and stages); only RL jobs resume")
        cfg = load_config(JobConfig, args.config, args.set)
        check_broker(cfg.broker)
        job = LocalJob(cfg.topology, cfg.broker, cfg.stages, cfg.admission())
        return _supervise(job, cfg.name, cfg.timeout_s, _BrokerProgress(job))
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
        try:
            code = _supervise(job, run.cfg.name, run.cfg.timeout_s, run.progress(), watch=job.fail_on_dropped_handles)
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


def _launches_locally(args: argparse.Namespace) -> bool:
    """Whether the job starts its processes here (`launcher: local`, and every dataflow config), as
    its YAML file and `--set` say, read before the config is checked (a wrong guess only loses time)."""
    data = read_yaml(args.config)
    launcher = data.get("launcher", "local") if isinstance(data, dict) else "local"
    for assignment in args.set:
        key, _, value = assignment.partition("=")
        if key.strip() == "launcher":
            launcher = value.strip()
    return launcher == "local"


def is_dataflow_config(path: str) -> bool:
    """A config listing `topics` and `stages` itself (like broker_demo.yaml) rather than an RL job."""
    data = read_yaml(path)
    return isinstance(data, dict) and "topics" in data


def _supervise(job: Launcher, name: str, timeout_s: float, progress: AbstractContextManager,
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


class _BrokerProgress:
    """One progress line every few seconds from the broker's counters (dataflow configs)."""

    def __init__(self, job: LocalJob, every_s: float = 2.0):
        self.job = job
        self.every_s = every_s
        self._stop = threading.Event()

    def __enter__(self) -> _BrokerProgress:
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


def cmd_plan(args: argparse.Namespace) -> int:
    plan = _plan(args, prepare=False)
    print(plan.describe())
    out = plan.as_dict()
    if args.profile is not None or args.search or args.device is not None:
        out.update(_predict(args, plan))
    if args.json:
        print(json.dumps(out))
    return 0


def _predict(args: argparse.Namespace, plan: JobPlan) -> dict[str, object]:
    """Print the simulator's prediction of the config as planned (the placement auto chose) and
    with --search the best plans; their JSON keys."""
    from stream_rlhf.driver.dataflow import device_groups
    from stream_rlhf.planner.auto_placement import with_placement
    from stream_rlhf.planner.job_prediction import (
        analytic_costs,
        buildable_groups,
        buildable_with_rollout,
        describe,
        describe_device,
        job_profile,
        plan_dict,
    )
    from stream_rlhf.planner.search import predict, search, within_memory
    from stream_rlhf.rl.config import RLJobConfig

    if is_dataflow_config(args.config):
        raise ConfigError("plan --profile / --search / --device: predictions are for RL job configs")
    if args.memory_limit_mb is not None and not args.search:
        raise ConfigError("--memory-limit-mb: limits the plans of --search")
    if args.profile is not None and (args.device or args.prompt_tokens or args.response_tokens):
        raise ConfigError("--device, --prompt-tokens, --response-tokens: for analytic costs, not with --profile")
    cfg = load_config(RLJobConfig, args.config, args.set)
    if (auto := plan.placement_auto) is not None:
        cfg = with_placement(cfg, {key: auto["placement"][key] for key in auto["decided"]})
    flow = plan.flow
    stages = set(flow.stages)
    groups = buildable_groups(args.config, args.set, stages) if args.search else []
    moved = buildable_with_rollout(args.config, args.set, stages) if args.search else []
    if args.profile is not None:
        profile = job_profile(cfg, stages, args.profile)
        every = search(profile, cfg.iterations, groups=groups, with_rollout=moved) if args.search else []
        source = f"profile {args.profile}"
    else:
        profile, device, every = analytic_costs(cfg, flow, args.device, args.prompt_tokens, args.response_tokens,
                                                groups if args.search else None, moved)
        print(describe_device(device))
        source = device.name
    if args.memory_limit_mb is not None and profile.memory is None:
        raise ConfigError(f"--memory-limit-mb: {args.profile}/summary.json has no memory block to predict from"
                          if args.profile else "--memory-limit-mb: analytic costs have no host memory figures "
                          "(give --profile RUN_DIR)")
    prediction = predict(profile, cfg.iterations, cfg.schedule, cfg.overlap_depth, cfg.placement.mode,
                         device_groups(cfg, sorted(stages)), cfg.placement.with_rollout)
    plans, dropped = within_memory(every, args.memory_limit_mb)
    print(describe(prediction, plans[:args.top], profile, dropped, args.memory_limit_mb))
    found = {"plans": [plan_dict(p) for p in plans[:args.top]], "plans_over_memory_limit": dropped}
    return {"prediction": prediction.summary(), "costs": source,
            **(found if args.search else {})}


def cmd_broker(args: argparse.Namespace) -> int:
    from stream_rlhf.broker.control.server import BrokerServer

    flow = _plan(args, prepare=True).flow
    counters = BrokerServer(flow.topology, flow.broker, flow.admission).serve()
    print(json.dumps(counters, indent=2, sort_keys=True))
    return 0


def cmd_stage(args: argparse.Namespace) -> int:
    from stream_rlhf.launch.by_hand import HandRank

    rank = HandRank(_plan(args, prepare=False), args.stage, args.index, args.rank, args.broker, args.group)
    rank.start()
    rank.wait(timeout_s=float("inf"))
    return 0


def _plan(args: argparse.Namespace, prepare: bool) -> JobPlan:
    """The plan of either config kind. An RL job's dataset and warm start are made first with
    `prepare` (the broker by hand: the job's driver), else only located (`plan`, `stage`)."""
    if is_dataflow_config(args.config):
        cfg = load_config(JobConfig, args.config, args.set)
        if prepare:
            check_broker(cfg.broker)
        return JobPlan(cfg.name, Dataflow(cfg.topology, cfg.broker, cfg.stages, cfg.admission()))
    from stream_rlhf.driver.plan import preview_plan
    from stream_rlhf.rl.config import RLJobConfig

    cfg = load_config(RLJobConfig, args.config, args.set)
    if prepare:
        check_rl_job(cfg)
        _prepare(cfg)
    return preview_plan(cfg)


def _prepare(cfg: RLJobConfig) -> None:
    """Write the dataset and warm-start once (both cached), as `stream-rlhf run` does first (on a
    GPU job in a child process: the broker this precedes holds no CUDA context)."""
    from stream_rlhf.driver.warm_start import warm_start_off_driver
    from stream_rlhf.rl.task_data import resolve_data

    warm_start_off_driver(resolve_data(cfg))


def cmd_stats(args: argparse.Namespace) -> int:
    from stream_rlhf.broker.control.client import ControlClient

    with ControlClient(args.address, args.keys) as client:
        print(json.dumps(client.stats(), indent=2, sort_keys=True))
    return 0


def cmd_keys(args: argparse.Namespace) -> int:
    from stream_rlhf.broker.sockets import generate_keys

    path = generate_keys(args.dir)
    print(f"wrote CURVE keys to {path} (broker.key_secret, client.key_secret, authorized_clients/)")
    return 0


def cmd_view(args: argparse.Namespace) -> int:
    from stream_rlhf.viewer.page import PAGE_FILE, write_page
    from stream_rlhf.viewer.serve import folder_server

    if not Path(args.run_dir).is_dir():
        raise ConfigError(f"view {args.run_dir}: not a folder (a run folder, like runs/<name>)")
    if args.port is not None and not args.serve:
        raise ConfigError(f"--port {args.port}: only with --serve")
    print(f"wrote {write_page(args.run_dir)}")
    if not args.serve:
        return 0
    port = 8765 if args.port is None else args.port
    try:
        server = folder_server(args.run_dir, port)
    except OSError as exc:
        raise ConfigError(f"--port {port}: cannot serve on 127.0.0.1:{port} ({exc.strerror or exc})") from None
    with server:
        address = f"http://127.0.0.1:{server.server_address[1]}/{PAGE_FILE}"
        print(f"serving {args.run_dir} at {address} (Ctrl-C stops)", flush=True)
        try:
            server.serve_forever()
        except KeyboardInterrupt:
            pass
    return 0


def cmd_episodes(args: argparse.Namespace) -> int:
    from stream_rlhf.driver import try_episodes as episodes
    from stream_rlhf.driver.warm_start import warm_start
    from stream_rlhf.rl.config import RLJobConfig
    from stream_rlhf.rl.task_data import resolve_data

    cfg = load_config(RLJobConfig, args.config, args.set)
    check_rl_job(cfg)
    episodes.check_request(cfg, args.count)
    if args.checkpoint is not None and not Path(args.checkpoint, "config.json").is_file():
        raise ConfigError(f"--checkpoint {args.checkpoint}: no config.json there (a checkpoint folder)")
    cfg = resolve_data(cfg)  # the task's data, made once (cached), as `run` makes it
    checkpoint = args.checkpoint or str(warm_start(cfg))
    records, seconds, decode = episodes.try_episodes(cfg, checkpoint, args.count, args.greedy)
    print(episodes.report(records, seconds, decode))
    if args.json:
        print(episodes.json_line(records, seconds, decode))
    return 1 if episodes.failed(records) else 0


def cmd_init_model(args: argparse.Namespace) -> int:
    from stream_rlhf.models.checkpoint import build_tiny, save_checkpoint
    from stream_rlhf.models.tokenizer import build_tokenizer
    from stream_rlhf.rl.config import RLJobConfig

    cfg = load_config(RLJobConfig, args.config, args.set)
    if Path(args.folder).exists():
        raise ConfigError(f"init-model {args.folder}: already exists (name a new folder)")
    tokenizer = build_tokenizer(vision=cfg.model.tiny.vision is not None)
    model = build_tiny(cfg.model.tiny, tokenizer, cfg.model.seed)
    save_checkpoint(model, tokenizer, args.folder)
    size = sum(p.numel() for p in model.parameters())
    print(f"wrote {args.folder}: {type(model).__name__}, {size / 1e6:.2f}M parameters, random weights")
    return 0


COMMANDS = {"run": cmd_run, "plan": cmd_plan, "broker": cmd_broker, "stage": cmd_stage, "stats": cmd_stats,
            "keys": cmd_keys, "view": cmd_view, "episodes": cmd_episodes, "init-model": cmd_init_model}

if __name__ == "__main__":
    sys.exit(main())
