"""The smaller commands: `stats` (a running broker's counters), `keys` (CURVE keys), `view` (the
samples page of a run), `episodes` (an env job's episodes turn by turn), `init-model` (a random
model folder for model.path).

    code = cmd_view(args)      # each takes the parsed arguments of its sub-command (cli.py)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from stream_rlhf.config import ConfigError, load_config
from stream_rlhf.driver.preflight import check_rl_job


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
