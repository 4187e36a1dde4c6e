"""`stream-rlhf plan`, `broker` and `stage`: a job's plan, printed (with the planner's predictions) or
run one part at a time by hand (the broker here, a stage there: SLURM, k8s; `launch/by_hand.py`).

    print(job_plan(args, prepare=False).describe())
"""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING

from stream_rlhf.commands.run import is_dataflow_config
from stream_rlhf.config import ConfigError, load_config
from stream_rlhf.driver.preflight import check_broker, check_rl_job
from stream_rlhf.job import JobConfig
from stream_rlhf.launch.plan import Dataflow, JobPlan

if TYPE_CHECKING:
    from stream_rlhf.rl.config import RLJobConfig


def cmd_plan(args: argparse.Namespace) -> int:
    plan = job_plan(args, prepare=False)
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

    flow = job_plan(args, prepare=True).flow
    counters = BrokerServer(flow.topology, flow.broker, flow.admission).serve()
    print(json.dumps(counters, indent=2, sort_keys=True))
    return 0


def cmd_stage(args: argparse.Namespace) -> int:
    from stream_rlhf.launch.by_hand import HandRank

    rank = HandRank(job_plan(args, prepare=False), args.stage, args.index, args.rank, args.broker, args.group)
    rank.start()
    rank.wait(timeout_s=float("inf"))
    return 0


def job_plan(args: argparse.Namespace, prepare: bool) -> JobPlan:
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
