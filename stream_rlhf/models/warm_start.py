"""SFT warm start of the embedded tiny model, cached in a local folder.

    path = warm_start(config)   # a Hugging Face checkpoint folder (weights + tokenizer)

A random model never earns a reward, so RL would have nothing to reinforce. A few hundred SFT
steps on the task's train split give a policy that sometimes succeeds. The result is saved under
`model.warm_start.cache_dir/<hash>/`, where the hash covers the tiny model, the task and the SFT
settings: a second run with the same settings loads it in a second. A config with `model.path`
skips all of this and uses that checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from dataclasses import asdict
from pathlib import Path

import torch

from stream_rlhf.data.arithmetic import problems
from stream_rlhf.models.checkpoint import build_tiny
from stream_rlhf.models.tokenizer import build_tokenizer
from stream_rlhf.rl.config import RLJobConfig

log = logging.getLogger(__name__)


def warm_start(cfg: RLJobConfig) -> Path:
    """The checkpoint folder RL starts from: `model.path`, or the cached (or new) tiny SFT model."""
    if cfg.model.path is not None:
        return Path(cfg.model.path)
    settings = {"tiny": asdict(cfg.model.tiny), "sft": asdict(cfg.model.warm_start), "task": asdict(cfg.task),
                "seed": cfg.model.seed}
    settings["sft"].pop("cache_dir")
    settings["task"].pop("eval_prompts")  # evaluation does not change what SFT learns
    key = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]
    folder = Path(cfg.model.warm_start.cache_dir) / f"tiny-{key}"
    if (folder / "config.json").is_file():
        log.info("warm start: cached SFT model %s", folder)
        return folder
    model, tokenizer = _train(cfg)
    partial = folder.with_name(f"{folder.name}.partial-{os.getpid()}")  # runs started together do not collide
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    (partial / "warm_start.json").write_text(json.dumps(settings, indent=2))
    try:
        partial.rename(folder)  # a crash mid-save never leaves a folder that looks finished
    except OSError:
        if not (folder / "config.json").is_file():
            raise
        shutil.rmtree(partial)  # another run finished the same warm start first: use theirs
    return folder


def _train(cfg: RLJobConfig):
    sft = cfg.model.warm_start
    tokenizer = build_tokenizer()
    model = build_tiny(cfg.model.tiny, tokenizer, cfg.model.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=sft.lr, weight_decay=0.0)
    data = problems("train", sft.steps * sft.batch_size, cfg.task.seed + 1, cfg.task.max_operand)
    started = time.monotonic()
    log.info("warm start: %d SFT steps of %d examples on a new tiny model", sft.steps, sft.batch_size)
    for step in range(sft.steps):
        batch = data[step * sft.batch_size:(step + 1) * sft.batch_size]
        input_ids, labels, mask = _sft_batch(tokenizer, [(p.prompt, p.answer) for p in batch])
        loss = model(input_ids=input_ids, attention_mask=mask, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if (step + 1) % 100 == 0 or step + 1 == sft.steps:
            log.info("warm start: step %d/%d, loss %.3f, %.0fs", step + 1, sft.steps, loss.item(),
                     time.monotonic() - started)
    return model.eval(), tokenizer


def _sft_batch(tokenizer, pairs: list[tuple[str, str]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded (B, L) input ids, labels (-100 outside the answer) and attention mask."""
    rows, targets = [], []
    for prompt, answer in pairs:
        prompt_ids = [tokenizer.bos_token_id, *tokenizer.encode(prompt, add_special_tokens=False)]
        answer_ids = [*tokenizer.encode(answer, add_special_tokens=False), tokenizer.eos_token_id]
        rows.append(prompt_ids + answer_ids)
        targets.append([-100] * len(prompt_ids) + answer_ids)
    length = max(map(len, rows))
    input_ids = torch.tensor([r + [tokenizer.pad_token_id] * (length - len(r)) for r in rows])  # (B, L)
    labels = torch.tensor([t + [-100] * (length - len(t)) for t in targets])  # (B, L)
    mask = torch.tensor([[1] * len(r) + [0] * (length - len(r)) for r in rows])  # (B, L)
    return input_ids, labels, mask
