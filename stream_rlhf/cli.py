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
import atexit
import importlib
import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path

from stream_rlhf.config import ConfigError, read_yaml
from stream_rlhf.data.errors import DataError
from stream_rlhf.launch.process_start import start_fork_server
from stream_rlhf.launch.spec import setup_logging

CONFIG_REFERENCE = ("Every config key, with its type, default, constraint and description: docs/config.md "
                    "(generated from the config classes by python -m stream_rlhf.config_reference).")
"""The epilog of `stream-rlhf run --help`."""
COMMANDS = {"run": "run", "plan": "plan", "broker": "plan", "stage": "plan", "stats": "tools", "keys": "tools",
            "view": "tools", "episodes": "tools", "init-model": "tools"}
"""Each sub-command's module in `stream_rlhf/commands/` (its function: cmd_<name>)."""


def main(argv: list[str] | None = None) -> int:
    """Parse `argv` and run its sub-command: its exit code (2 for a config or data error, printed)."""
    args = _parser().parse_args(argv)
    setup_logging()
    try:
        if args.command == "run" and _launches_locally(args):
            start_fork_server()  # before this process imports torch: the server's imports run beside ours
        return command(args.command)(args)
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    except DataError as exc:
        print(f"data error: {exc}", file=sys.stderr)
        return 2


def entry() -> None:
    """The `stream-rlhf` program: `main`, then an exit without the interpreter's finalization. Over a
    driver's heap (torch, transformers, Triton and a run's records) its last garbage collection took
    ~1.3 s of every job. What an exit must still do is done first: the other threads that are not
    daemons are waited for, and the exit handlers run (logging's flush, multiprocessing's children)."""
    code = main()
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def command(name: str) -> Callable[[argparse.Namespace], int]:
    """The sub-command's function, imported only now (the heavy modules come with it)."""
    module = importlib.import_module(f"stream_rlhf.commands.{COMMANDS[name]}")
    return getattr(module, f"cmd_{name.replace('-', '_')}")


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


def _parser() -> argparse.ArgumentParser:
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
    return parser


if __name__ == "__main__":
    entry()
