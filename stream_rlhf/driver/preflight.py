"""Preflight: every path and resource a config names is checked before any process starts, so a
mistake is one line naming its config key (exit 2) instead of a stage that dies after launch.

    check_broker(cfg.broker)     # a dataflow job (broker_demo.yaml): its CURVE key folder
    check_rl_job(cfg)            # an RL job: that, and its model folders, dataset files, Ray address

What is checked:

    broker.curve.key_dir          a folder holding every key file (`sockets.KEY_FILES`), each a ZMQ
                                  certificate that loads, and authorized_clients/ with a public key
    model.path                    a checkpoint folder: config.json (JSON), weights, a tokenizer
    actor|critic.lora             with model.path: each of target_modules names weights of its decoder layers
                                  (`<layers>.N.<...>.<name>.weight`, read from its safetensors)
    reward.model_path,            checkpoint folders: config.json (JSON) and weights (they share the
    reward.process.model_path     policy's tokenizer)
    data.train, data.eval         readable files (their lines and images: `rl/task_data.check_prompts`)
    ray.address                   "auto", "local", HOST:PORT or ray://HOST:PORT

A missing config.json is already refused when the config is built (`model_config.py`).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING

import zmq.auth

from stream_rlhf.broker.control.topology import BrokerConfig
from stream_rlhf.broker.sockets import KEY_FILES
from stream_rlhf.config import ConfigError

if TYPE_CHECKING:  # the CLI imports this module for dataflow jobs too, which need no torch
    from stream_rlhf.rl.config import RLJobConfig

WEIGHT_FILES = ("*.safetensors", "pytorch_model*.bin", "model.safetensors.index.json", "pytorch_model.bin.index.json")
"""A checkpoint folder holds its weights as one of these (transformers' names)."""
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
"""A tokenizer transformers loads from a folder has one of these."""
LAYER_WEIGHT = re.compile(r"\.layers\.\d+\.(?:[^.]+\.)*?([^.]+)\.weight$")
"""A decoder layer's weight in Hugging Face names (`model.layers.3.self_attn.q_proj.weight`): its module's name."""
RAY_ADDRESS = re.compile(r"(?:ray://)?(?P<host>[^\s:/]+):(?P<port>\d+)")
"""HOST:PORT or ray://HOST:PORT; "auto" and "local" are Ray's words for a cluster found here."""


def check_broker(broker: BrokerConfig, prefix: str = "broker") -> None:
    """The CURVE key folder of `broker` (if any): `stream-rlhf keys DIR` wrote it whole."""
    if broker.curve is None:
        return
    key = f"{prefix}.curve.key_dir={broker.curve.key_dir!r}"
    folder = Path(broker.curve.key_dir)
    hint = f"(create keys with `stream-rlhf keys {folder}`)"
    if not folder.is_dir():
        raise ConfigError(f"{key}: no such folder {hint}")
    for name in KEY_FILES:
        path = folder / name
        if not path.is_file():
            raise ConfigError(f"{key}: {name} is missing {hint}")
        try:
            zmq.auth.load_certificate(path)
        except (OSError, ValueError) as error:
            raise ConfigError(f"{key}: {name} is not a CURVE key file ({error})") from None
    if not any((folder / "authorized_clients").glob("*.key")):
        raise ConfigError(f"{key}: authorized_clients/ holds no client public key {hint}")


def check_rl_job(cfg: RLJobConfig) -> None:
    """Every path and address of an RL job's config (see the module docstring)."""
    check_broker(cfg.broker)
    if cfg.model.path is not None:
        check_checkpoint(cfg.model.path, "model.path", tokenizer=True)
        for key, lora in (("actor", cfg.actor.lora), ("critic", cfg.critic.lora)):
            if lora is not None:
                check_lora_targets(cfg.model.path, lora.target_modules, f"{key}.lora")
    if cfg.reward.model_path is not None:
        check_checkpoint(cfg.reward.model_path, "reward.model_path", tokenizer=False)
    if cfg.reward.process is not None and cfg.reward.process.model_path is not None:
        check_checkpoint(cfg.reward.process.model_path, "reward.process.model_path", tokenizer=False)
    for split in ("train", "eval"):
        path = getattr(cfg.data, split)
        if path is not None and not os.access(path, os.R_OK):
            raise ConfigError(f"data.{split}={path!r}: cannot be read (permissions)")
    if cfg.launcher == "ray" and cfg.ray.address is not None:
        check_ray_address(cfg.ray.address)


def check_checkpoint(folder: str, key: str, tokenizer: bool) -> None:
    """A Hugging Face checkpoint folder: config.json that parses, weights, and (with `tokenizer`)
    a tokenizer; a ConfigError "key='folder': ..." naming what is missing."""
    path = Path(folder)
    try:
        json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as error:
        raise ConfigError(f"{key}={folder!r}: config.json does not read as JSON ({error})") from None
    if not any(any(path.glob(pattern)) for pattern in WEIGHT_FILES):
        raise ConfigError(f"{key}={folder!r}: no weights there (expected {', '.join(WEIGHT_FILES)})")
    if tokenizer and not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise ConfigError(f"{key}={folder!r}: no tokenizer there (expected one of {', '.join(TOKENIZER_FILES)})")


def check_lora_targets(folder: str, targets: list[str], key: str) -> None:
    """Each of `targets` (`key`.target_modules) names a linear layer of the decoder layers of the
    checkpoint in `folder` (its safetensors' weight names; a checkpoint of .bin files is left to
    the engine's own check)."""
    path = Path(folder)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = list(json.loads(index.read_text())["weight_map"])
    else:
        from safetensors import safe_open  # with torch: an RL job's preflight only

        names = []
        for file in sorted(path.glob("*.safetensors")):
            with safe_open(file, "pt") as weights:
                names += list(weights.keys())
        if not names:
            return
    layer_weights = [m.group(1) for name in names if (m := LAYER_WEIGHT.search(name))]
    missing = [t for t in targets if t not in layer_weights]
    if missing:
        raise ConfigError(f"{key}.target_modules: {missing} name no linear layer of the decoder layers of "
                          f"model.path={folder!r} (they have {sorted(set(layer_weights))})")


def check_ray_address(address: str) -> None:
    """`ray.address` in a form `ray.init` takes; a ConfigError naming it otherwise."""
    if address in ("auto", "local"):
        return
    form = RAY_ADDRESS.fullmatch(address)
    if form is None or not 1 <= int(form["port"]) <= 65535:
        raise ConfigError(f"ray.address={address!r}: expected \"auto\", \"local\", HOST:PORT or ray://HOST:PORT "
                          "(a port in 1..65535)")
