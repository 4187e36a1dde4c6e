"""The `stream-rlhf` command.

    stream-rlhf run CONFIG [--set key=value ...]   broker + every stage as local processes
    stream-rlhf broker CONFIG                      only the broker (stages started elsewhere)
    stream-rlhf stage CONFIG STAGE --broker ADDR [--index N] [--set key=value]   one instance (SLURM, k8s)
    stream-rlhf stats ADDR                         the broker's counters
    stream-rlhf keys DIR                           CURVE keys for a broker bound beyond loopback
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
import time

from stream_rlhf.config import ConfigError, load_config
from stream_rlhf.job import JobConfig
from stream_rlhf.launch.local import LocalJob, StageFailed, run_stage, setup_logging

log = logging.getLogger("stream_rlhf")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="stream-rlhf", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a job on this machine")
    run.add_argument("config")
    run.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    broker = sub.add_parser("broker", help="run only the broker of a job")
    broker.add_argument("config")
    broker.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    stage = sub.add_parser("stage", help="run one stage instance of a job")
    stage.add_argument("config")
    stage.add_argument("stage")
    stage.add_argument("--broker", required=True, help="broker address, e.g. tcp://10.0.0.1:5555")
    stage.add_argument("--index", type=int, default=0)
    stage.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    stats = sub.add_parser("stats", help="print a running broker's counters")
    stats.add_argument("address")
    stats.add_argument("--keys", default=None, help="CURVE key folder")
    keys = sub.add_parser("keys", help="write CURVE keys into DIR")
    keys.add_argument("dir")
    args = parser.parse_args(argv)
    setup_logging()
    try:
        return COMMANDS[args.command](args)
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2


def cmd_run(args: argparse.Namespace) -> int:
    cfg = load_config(JobConfig, args.config, args.set)
    job = LocalJob(cfg.topology, cfg.broker, cfg.stages, cfg.admission())
    signal.signal(signal.SIGTERM, _interrupt)  # `kill`, a scheduler's stop: drain as for Ctrl-C
    address = job.start()
    log.info("job %s: broker at %s, %d stage process(es)", cfg.name, address, len(job.processes))
    stop_progress = threading.Event()
    threading.Thread(target=_progress, args=(job, stop_progress), daemon=True).start()
    try:
        job.wait(cfg.timeout_s)
    except KeyboardInterrupt:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # let the drain below finish
        log.warning("interrupted: draining every stage")
        return 130
    except (StageFailed, TimeoutError) as exc:
        log.error("job %s failed: %s", cfg.name, exc)
        return 1
    finally:
        stop_progress.set()
        job.stop()
    log.info("job %s finished", cfg.name)
    return 0


def _interrupt(*_) -> None:
    raise KeyboardInterrupt


def _progress(job: LocalJob, stop: threading.Event, every_s: float = 2.0) -> None:
    """One progress line every few seconds from the broker's counters."""
    started = time.monotonic()
    while not stop.wait(every_s):
        try:
            with job.client() as client:
                s = client.stats()
        except Exception:
            continue
        queued = sum(v for k, v in s.items() if k.startswith("queue."))
        log.info(
            "[%5.1fs] published %d, delivered %d, completed %d, joins %d, queued %d, policy v%d",
            time.monotonic() - started, s.get("published", 0), s.get("delivered", 0),
            s.get("completed", 0), s.get("joins_emitted", 0), queued, s.get("policy_version", 0),
        )


def cmd_broker(args: argparse.Namespace) -> int:
    from stream_rlhf.broker.server import BrokerServer

    cfg = load_config(JobConfig, args.config, args.set)
    counters = BrokerServer(cfg.topology, cfg.broker, cfg.admission()).serve()
    print(json.dumps(counters, indent=2, sort_keys=True))
    return 0


def cmd_stage(args: argparse.Namespace) -> int:
    cfg = load_config(JobConfig, args.config, args.set)
    if args.stage not in cfg.stages:
        raise ConfigError(f"stage {args.stage!r} is not in stages ({', '.join(cfg.stages)})")
    key_dir = cfg.broker.curve.key_dir if cfg.broker.curve else None
    run_stage(args.stage, f"{args.stage}-{args.index}", cfg.stages[args.stage], args.broker, key_dir, cfg.broker.shm_prefix)
    return 0


def cmd_stats(args: argparse.Namespace) -> int:
    from stream_rlhf.broker.client import ControlClient

    with ControlClient(args.address, args.keys) as client:
        print(json.dumps(client.stats(), indent=2, sort_keys=True))
    return 0


def cmd_keys(args: argparse.Namespace) -> int:
    from stream_rlhf.broker.sockets import generate_keys

    path = generate_keys(args.dir)
    print(f"wrote CURVE keys to {path} (broker.key_secret, client.key_secret, authorized_clients/)")
    return 0


COMMANDS = {"run": cmd_run, "broker": cmd_broker, "stage": cmd_stage, "stats": cmd_stats, "keys": cmd_keys}

if __name__ == "__main__":
    sys.exit(main())
