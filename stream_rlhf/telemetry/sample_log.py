"""The bounded sample log: a few samples of every trained mini-batch, token by token, in
runs/<name>/samples.jsonl, for the per-sample viewer (`stream-rlhf view`, `viewer/`).

    log = SampleLog(run_dir, cfg.samples_log, tokenizer, start_version)   # actor_train's leader
    log.write(batches, exp, advantages, kl, trainer_version)     # once per trained iteration

One JSON object a line (`SampleRecord` fields): iteration, minibatch, sample (its index in the
mini-batch), policy_version (that generated it), staleness (trainer version minus that), reward
(an episode's: its return, score + turn rewards), prompt (text; a run of image tokens shows as
<image>), response (text; an episode's observations included), tokens (each response token
decoded on its own), logprob (behaviour log-prob per token), advantage (per token), kl (per
token, vs the reference; null when the job has no reference), images (the prompt's image files,
then those an episode's observations showed; empty for text) and turns (a multi-turn episode's
response as [start, end, kind] token spans, kind "policy" or "observation", from the handle's
`loss_mask`; null for one response). At most
`per_minibatch` lines per mini-batch, spread evenly over it, so the file holds at most
per_minibatch * rollout_batch.minibatches lines per iteration: opening the log cuts what it holds
from `start_version` on (a resumed run continues from its checkpoint; a fresh one starts empty).
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

from msgspec import Meta

from stream_rlhf.config import check_fields
from stream_rlhf.telemetry.metrics import cut_metrics

if TYPE_CHECKING:  # the config half of this file is read before any model: no torch at import
    from torch import Tensor
    from transformers import PreTrainedTokenizerBase

    from stream_rlhf.experience import Experience
    from stream_rlhf.stage import Batch

SAMPLES_FILE = "samples.jsonl"
IMAGE_PATHS = "image_paths"
"""Handle metadata of a vision-language prompt source: per sample, its image files joined by newlines."""
IMAGE_SPAN = re.compile(r"<\|vision_start\|>(?:<\|image_pad\|>)*<\|vision_end\|>")
DIGITS = 4
"""Decimals kept of every float."""
LOSS_MASK = "loss_mask"
"""The ragged (R_i,) bool tensor of a multi-turn job's handles: True on policy tokens."""
POLICY, OBSERVATION = "policy", "observation"


@dataclass(frozen=True)
class SampleLogConfig:
    """The `samples_log` section of an RL job."""

    per_minibatch: Annotated[int, Meta(ge=0)] = 2
    """Samples logged of every trained mini-batch (evenly spread over it); 0 turns the log off."""

    def __post_init__(self) -> None:
        check_fields(self)


@dataclass(frozen=True)
class SampleRecord:
    """One line of samples.jsonl."""

    iteration: int
    minibatch: int
    sample: int
    policy_version: int
    staleness: int
    reward: float
    prompt: str
    response: str
    tokens: list[str]
    logprob: list[float]
    advantage: list[float]
    kl: list[float] | None
    images: list[str]
    turns: list[tuple[int, int, str]] | None = None
    """[start, end) spans of the response's tokens, kind "policy" (loss mask 1) or "observation";
    None for a single-turn sample."""
    trained: bool = True
    """False for a failed episode that `env.failed_episodes: mask` leaves out of training: none of
    its tokens carries a loss (its advantages are logged as 0)."""
    truncated: bool = False
    """Cut by its length limit (rollout.max_new_tokens without a stop, env.max_episode_tokens): with
    `algorithm.mask_truncated` none of its tokens carries a loss."""
    left_out: str | None = None
    """Why `algorithm.dynamic_sampling` left it out of the actor's training ("group returns all
    equal", "surplus group"); None: not left out."""


def logged_indices(num_samples: int, per_minibatch: int) -> list[int]:
    """Which samples of a mini-batch of `num_samples` are logged: `per_minibatch` of them (or all),
    evenly spread from the first to the last."""
    count = min(per_minibatch, num_samples)
    if count <= 1:
        return list(range(count))
    return sorted({round(j * (num_samples - 1) / (count - 1)) for j in range(count)})


def turn_spans(loss_mask: list[bool]) -> list[tuple[int, int, str]]:
    """The runs of a response's loss mask as [start, end, kind] spans: [T, T, F, T] ->
    [(0, 2, "policy"), (2, 3, "observation"), (3, 4, "policy")]."""
    spans: list[tuple[int, int, str]] = []
    start = 0
    for i in range(1, len(loss_mask) + 1):
        if i == len(loss_mask) or loss_mask[i] != loss_mask[start]:
            spans.append((start, i, POLICY if loss_mask[start] else OBSERVATION))
            start = i
    return spans


class SampleLog:
    def __init__(self, run_dir: str | Path, cfg: SampleLogConfig, tokenizer: PreTrainedTokenizerBase,
                 start_version: int = 0):
        self.path = Path(run_dir) / SAMPLES_FILE
        cut_metrics(self.path, start_version)
        self.per_minibatch = cfg.per_minibatch
        self.tokenizer = tokenizer

    def write(self, batches: list[Batch], exp: Experience, advantages: Tensor, kl: Tensor, version: int,
              left_out: list[str | None] | None = None) -> None:
        """Log the chosen samples of `batches` (the mini-batches `exp` was built from, in order);
        `advantages` and `kl` are (N, R) like `exp.mask`, `version` the trainer's policy version,
        `left_out` (N,) why dynamic sampling left each sample out of training (None: it trains)."""
        lines, offset = [], 0
        for batch in batches:
            paths = batch.metadata.get(IMAGE_PATHS) or [""] * batch.num_samples
            for index in logged_indices(batch.num_samples, self.per_minibatch):
                n = offset + index
                record = self._record(batch, index, exp, n, advantages[n], kl[n] if exp.ref_logp is not None else None,
                                      version, paths[index])
                if left_out is not None and left_out[n] is not None:
                    record = replace(record, left_out=left_out[n])
                lines.append(json.dumps(asdict(record)) + "\n")
            offset += batch.num_samples
        with self.path.open("a") as f:
            f.write("".join(lines))

    def _record(self, batch: Batch, index: int, exp: Experience, n: int, advantage: Tensor, kl: Tensor | None,
                version: int, paths: str) -> SampleRecord:
        sequence, prompt_len = exp.sequences[n].tolist(), int(exp.prompt_lens[n])
        response = sequence[prompt_len:]
        width = len(response)
        return SampleRecord(
            iteration=batch.iteration, minibatch=batch.minibatch, sample=index,
            policy_version=batch.policy_version, staleness=version - batch.policy_version,
            reward=round(float(exp.sample_returns()[n]), DIGITS),
            prompt=self._prompt_text(sequence[:prompt_len]),
            response=self.tokenizer.decode(response, skip_special_tokens=True),
            tokens=self.tokenizer.batch_decode([[token] for token in response]),
            logprob=_rounded(exp.behavior_logp[n, :width]),
            advantage=_rounded(advantage[:width]),
            kl=None if kl is None else _rounded(kl[:width]),
            images=paths.split("\n") if paths else [],
            turns=_turns(batch, index, width),
            trained=bool(batch.tensors["trained"][index]) if "trained" in batch.tensors else True,
            truncated=bool(batch.tensors["truncated"][index]) if "truncated" in batch.tensors else False,
        )

    def _prompt_text(self, ids: list[int]) -> str:
        """The prompt as text: its bos and padding left out, each image's token run as <image>."""
        text = IMAGE_SPAN.sub("<image>", self.tokenizer.decode(ids, skip_special_tokens=False))
        for token in {self.tokenizer.bos_token, self.tokenizer.pad_token} - {None}:
            text = text.replace(token, "")
        return text


def _turns(batch: Batch, index: int, width: int) -> list[tuple[int, int, str]] | None:
    """The turn spans of sample `index` of `batch`; None without a loss mask (one response)."""
    if LOSS_MASK not in batch.tensors:
        return None
    lens = batch.tensors[f"{LOSS_MASK}_lens"].tolist()
    start = sum(lens[:index])
    mask = batch.tensors[LOSS_MASK][start:start + lens[index]].tolist()
    if len(mask) != width:
        raise ValueError(f"sample {index} of mini-batch {batch.iteration}/{batch.minibatch}: "
                         f"{LOSS_MASK} has {len(mask)} entries for {width} response tokens")
    return turn_spans(mask)


def _rounded(values: Tensor) -> list[float]:
    return [round(v, DIGITS) + 0.0 for v in values.tolist()]  # + 0.0: no -0.0
