"""SFT warm start of the embedded tiny model, cached in a local folder.

    path = warm_start(config)   # a Hugging Face checkpoint folder (weights + tokenizer)

A random model never earns a reward, so RL would have nothing to reinforce. A few hundred SFT
steps on the task's train split (the arithmetic problems, or the JSONL prompts of `data.train`,
images included) give a policy that sometimes succeeds. A multi-turn task's demonstrations are
made of turns (`data/demonstration.py`): tool_sums shows a calculator call, its result and the
answer on `task.tool_fraction` of them, shapes_dialogue both questions; the policy's turns are
trained on, the observations between them are input only (no loss), as in RL. A
vision-language model trains its vision tower here too; RL then keeps it frozen. It trains on the
job's device (`placement.device`; `stream-rlhf run` runs it in a child process there,
`device_child.py`, when the cache lacks it: `warm_start_off_driver`). The result is saved under
`model.warm_start.cache_dir/<hash>/`, where the hash covers the tiny model, the task, the SFT
settings and the content of `data.train` (not its path: a cache folder copied to another machine
or checkout is found there): a second run with the same settings loads it in a second. A config
with `model.path` skips all of this and uses that checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import asdict
from pathlib import Path

import torch

from stream_rlhf.algos.medusa import heads_loss
from stream_rlhf.cache_folder import build_once
from stream_rlhf.data import shapes, shapes_dialogue, tool_sums
from stream_rlhf.data.demonstration import IGNORE, Segment, answer_only, demonstration_rows
from stream_rlhf.data.images import DEFAULT_MAX_PIXELS, DEFAULT_MIN_PIXELS
from stream_rlhf.data.prompts_jsonl import PromptSample
from stream_rlhf.data.rows import dataset_sha256
from stream_rlhf.data.task_config import DataConfig, TaskConfig
from stream_rlhf.data.text_tasks import problems
from stream_rlhf.data.tokenizer import load_tokenizer
from stream_rlhf.driver.device_child import on_job_device
from stream_rlhf.models.checkpoint import build_tiny, load_policy, save_checkpoint
from stream_rlhf.models.medusa import MedusaHeads, heads_folder, save_heads
from stream_rlhf.models.packing import packed_hidden_states
from stream_rlhf.models.tokenizer import build_tokenizer
from stream_rlhf.rl.config import RLJobConfig
from stream_rlhf.rl.task_data import open_prompts

log = logging.getLogger(__name__)


def warm_start(cfg: RLJobConfig) -> Path:
    """The checkpoint folder RL starts from: `model.path`, or the cached (or new) tiny SFT model."""
    if cfg.model.path is not None:
        return Path(cfg.model.path)
    folder, settings = _cache_folder(cfg)
    if (folder / "config.json").is_file():
        log.info("warm start: cached SFT model %s", folder)

    def build(partial: Path) -> None:
        model, tokenizer = _train(cfg)
        save_checkpoint(model, tokenizer, partial)
        (partial / "warm_start.json").write_text(json.dumps(settings, indent=2))

    build_once(folder, "config.json", build)
    _ensure_heads(cfg, folder)
    return folder


def warm_start_folder(cfg: RLJobConfig) -> tuple[Path, bool]:
    """(the checkpoint folder `warm_start` returns, whether it is there already): nothing is trained."""
    if cfg.model.path is not None:
        return Path(cfg.model.path), Path(cfg.model.path).is_dir()
    folder, _ = _cache_folder(cfg)
    return folder, (folder / "config.json").is_file()


def _cache_folder(cfg: RLJobConfig) -> tuple[Path, dict]:
    """The warm start's cache folder and the settings its name hashes."""
    settings = {"tiny": asdict(cfg.model.tiny), "sft": asdict(cfg.model.warm_start), "task": asdict(cfg.task),
                "seed": cfg.model.seed}
    settings["sft"].pop("cache_dir")
    if cfg.model.tiny.architecture == "qwen2":  # (left out, so the warm starts cached before it existed stay valid)
        settings["tiny"].pop("architecture")
    settings["task"].pop("eval_prompts")  # evaluation does not change what SFT learns
    if cfg.task.name != "tool_sums":  # (only tool_sums has it: the entries cached before it existed stay valid)
        settings["task"].pop("tool_fraction")
    if cfg.task.name == "tool_sums":
        settings["task"] = {k: settings["task"][k] for k in ("name", "max_operand", "seed", "tool_fraction")}
    if cfg.task.name == "arithmetic":
        settings["task"] = {k: settings["task"][k] for k in ("name", "max_operand", "seed")}
        if cfg.task.terms != 2:  # (left out at 2, so the warm starts cached before terms existed stay valid)
            settings["task"]["terms"] = cfg.task.terms
    if cfg.data.train is not None:  # its content, not its path or time: a copied cache stays valid elsewhere
        data = cfg.data
        settings["data"] = {"train_sha256": dataset_sha256(data.train),
                            "min_pixels": data.min_pixels or DEFAULT_MIN_PIXELS,  # a tiny model's folder has no
                            "max_pixels": data.max_pixels or DEFAULT_MAX_PIXELS}  # preprocessor_config.json
        defaults = DataConfig()
        changed = {name: getattr(data, name) for name in ("fields", "chat_template", "system_prompt")
                   if getattr(data, name) != getattr(defaults, name)}
        settings["data"].update(changed)  # (only when set, so the entries cached before they existed stay valid)
    key = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]
    return Path(cfg.model.warm_start.cache_dir) / f"tiny-{key}", settings


def _train(cfg: RLJobConfig):
    sft = cfg.model.warm_start
    device = _sft_device(cfg)
    tokenizer = build_tokenizer(vision=cfg.model.tiny.vision is not None)
    model = build_tiny(cfg.model.tiny, tokenizer, cfg.model.seed).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=sft.lr, weight_decay=0.0)
    dataset = open_prompts(cfg, model.config, tokenizer, "train", cfg.task.seed + 1)
    if dataset is None:
        data = problems(cfg.task, "train", sft.steps * sft.batch_size, cfg.task.seed + 1)
        demonstrations = _text_demonstrations(cfg.task, data)
    started = time.monotonic()
    log.info("warm start: %d SFT steps of %d examples on a new tiny model (%s)", sft.steps, sft.batch_size, device)
    for step in range(sft.steps):
        if dataset is None:
            batch = slice(step * sft.batch_size, (step + 1) * sft.batch_size)
            prompts = [torch.tensor([tokenizer.bos_token_id, *tokenizer.encode(p.prompt, add_special_tokens=False)])
                       for p in data[batch]]
            inputs = _sft_batch(tokenizer, prompts, demonstrations[batch])
        else:
            samples = [dataset.next_sample() for _ in range(sft.batch_size)]
            inputs = _sft_batch(tokenizer, [s.prompt_ids for s in samples],
                                [_sample_demonstration(cfg.task, s) for s in samples])
            inputs.update(_image_inputs(model, inputs["input_ids"], [im for s in samples for im in s.images]))
        loss = model(**{name: tensor.to(device) for name, tensor in inputs.items()}).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if (step + 1) % 100 == 0 or step + 1 == sft.steps:
            log.info("warm start: step %d/%d, loss %.3f, %.0fs", step + 1, sft.steps, loss.item(),
                     time.monotonic() - started)
    if dataset is not None and dataset.skipped:
        log.warning("warm start: skipped lines of %s: %s", cfg.data.train, dataset.skipped)
    return model.cpu().eval(), tokenizer


def _sft_device(cfg: RLJobConfig) -> torch.device:
    """Where the warm start trains: the job's device (`placement.device`), so a GPU job's model of
    hundreds of millions of parameters is not trained on the host's cores. The cache entry does
    not depend on it (a CPU-trained entry serves a GPU job and the other way round)."""
    return torch.device(cfg.placement.resolved_device())


def warm_start_off_driver(cfg: RLJobConfig) -> Path:
    """`warm_start` for a process that lives as long as the job (the driver, `broker CONFIG`): what
    must be trained is trained in a child process on a GPU job (`device_child.py`), so that this
    one holds no CUDA context; a cached warm start is only found here."""
    return warm_start(cfg) if warm_start_ready(cfg) else on_job_device(cfg, "warm start", warm_start, cfg)


def warm_start_ready(cfg: RLJobConfig) -> bool:
    """Whether `warm_start` would only load (the model and any Medusa heads it needs are cached)."""
    folder, cached = warm_start_folder(cfg)
    return cached and (cfg.model.path is not None or not _heads_missing(cfg, folder))


def _ensure_heads(cfg: RLJobConfig, folder: Path) -> None:
    """With `rollout.medusa` on, Medusa heads for the cached policy in `folder` (trained once per
    heads setting and kept beside it; the policy's own cache entry does not depend on them)."""
    if _heads_missing(cfg, folder):
        save_heads(_train_heads(cfg, load_policy(folder).eval(), load_tokenizer(folder)), folder)
        (heads_folder(folder) / "warm_start.json").write_text(json.dumps(_heads_settings(cfg)))


def _heads_settings(cfg: RLJobConfig) -> dict:
    medusa = cfg.rollout.medusa
    return {"heads": medusa.heads, "steps": medusa.warm_start_steps, "lr": medusa.lr, "seed": cfg.task.seed}


def _heads_missing(cfg: RLJobConfig, folder: Path) -> bool:
    """The job needs Medusa heads trained for `folder` and none with its settings are there (a
    JSONL dataset's job starts them from the LM head: companion training fits them)."""
    medusa = cfg.rollout.medusa
    if not medusa.enabled or medusa.warm_start_steps == 0 or cfg.data.train is not None:
        return False
    marker = heads_folder(folder) / "warm_start.json"
    return not (marker.is_file() and json.loads(marker.read_text()) == _heads_settings(cfg))


def _train_heads(cfg: RLJobConfig, model, tokenizer) -> MedusaHeads:
    """Medusa heads trained on the warm-started policy's hidden states over the SFT data (the
    backbone frozen), so speculative rollout starts with heads that fit the starting policy."""
    medusa = cfg.rollout.medusa
    batch_size = cfg.model.warm_start.batch_size
    model = model.to(_sft_device(cfg))
    heads = MedusaHeads.from_policy(model, medusa.heads)
    optimizer = torch.optim.AdamW(heads.parameters(), lr=medusa.lr, weight_decay=0.0)
    data = problems(cfg.task, "train", medusa.warm_start_steps * batch_size, cfg.task.seed + 2)
    for step in range(medusa.warm_start_steps):
        batch = data[step * batch_size:(step + 1) * batch_size]
        prompts = [[tokenizer.bos_token_id, *tokenizer.encode(p.prompt, add_special_tokens=False)] for p in batch]
        sequences = [torch.tensor(p + tokenizer.encode(b.answer, add_special_tokens=False) + [tokenizer.eos_token_id])
                     for p, b in zip(prompts, batch)]
        with torch.no_grad():
            hidden = packed_hidden_states(model, sequences)
        loss, metrics = heads_loss(heads, hidden, sequences, [len(p) for p in prompts])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if (step + 1) % 100 == 0 or step + 1 == medusa.warm_start_steps:
            log.info("warm start: Medusa heads step %d/%d, loss %.3f, head0 accuracy %.2f", step + 1,
                     medusa.warm_start_steps, loss.item(), float(metrics.get("head0_acc", 0.0)))
    return heads.cpu().eval()


def _text_demonstrations(task: TaskConfig, data: list) -> list[tuple[Segment, ...]]:
    """The demonstrations of an in-memory text task's problems (the answer alone, or tool_sums' turns)."""
    if task.name == "tool_sums":
        return tool_sums.demonstrations(data, task.tool_fraction, task.seed + 1)
    return [answer_only(p.answer) for p in data]


def _sample_demonstration(task: TaskConfig, sample: PromptSample) -> tuple[Segment, ...]:
    """The demonstration of a dataset sample: its answer, or both turns of shapes_dialogue (the
    second question's count read from the sample's image)."""
    if task.name == "shapes_dialogue":
        return shapes_dialogue.demonstration(sample.answer, shapes.read_squares(sample.image_paths[0]))
    return answer_only(sample.answer)


def _sft_batch(tokenizer, prompts: list[torch.Tensor],
               demonstrations: list[tuple[Segment, ...]]) -> dict[str, torch.Tensor]:
    """Right-padded (B, L) input ids, labels (IGNORE outside the policy's turns) and attention mask."""
    rows, targets = [], []
    for prompt_ids, segments in zip(prompts, demonstrations, strict=True):
        ids, labels = demonstration_rows(tokenizer, prompt_ids.tolist(), segments)
        rows.append(ids)
        targets.append(labels)
    length = max(map(len, rows))
    input_ids = torch.tensor([r + [tokenizer.pad_token_id] * (length - len(r)) for r in rows])  # (B, L)
    labels = torch.tensor([t + [IGNORE] * (length - len(t)) for t in targets])  # (B, L)
    mask = torch.tensor([[1] * len(r) + [0] * (length - len(r)) for r in rows])  # (B, L)
    return {"input_ids": input_ids, "labels": labels, "attention_mask": mask}


def _image_inputs(model, input_ids: torch.Tensor, images: list) -> dict[str, torch.Tensor]:
    """The full vision-language forward's image arguments for a batch (nothing for text lines)."""
    if not images:
        return {}
    return {
        "pixel_values": torch.cat([im.pixel_values for im in images]),
        "image_grid_thw": torch.stack([im.grid_thw for im in images]),
        "mm_token_type_ids": (input_ids == model.config.image_token_id).int(),
    }
