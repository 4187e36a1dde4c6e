"""Rollout's choice between speculative (Medusa) and plain decoding, mini-batch by mini-batch.

    speculation = Speculation(job, model)
    gen, info = speculation.generate(model, prompts, params, generator, policy_version)

Speculative decoding is lossless (`backends/speculative.py`), so the choice only moves speed:

- heads: the newest the `medusa_train` stage published (or the checkpoint's, before the first;
  fixed ones with `companion: false`). They are used only while the backbone they were trained
  against trails rollout's policy version by at most `max_lag`; otherwise decoding is plain.
- speed: every `probe_every`-th mini-batch runs the other mode, and rollout keeps the faster by
  seconds per generated token (moving averages); a switch is logged with both figures.

`info` goes into the rollout handle's metadata: decoding mode, verification steps, tokens, lag.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from stream_rlhf.backends.speculative import generate_speculative
from stream_rlhf.backends.speculative_static import generate_speculative_static
from stream_rlhf.backends.static_decode import StaticDecoder
from stream_rlhf.backends.static_sampler import sample
from stream_rlhf.backends.torch_rollout import Generation, SamplingParams
from stream_rlhf.models.medusa import load_rollout_heads
from stream_rlhf.weights.shm_store import WeightStore

if TYPE_CHECKING:  # the rollout stage's job, passed in: stages/ is above the engines
    from stream_rlhf.stages.job_context import JobContext

SMOOTHING = 0.3
"""Weight of the newest mini-batch in the seconds-per-token moving averages."""


class Speculation:
    def __init__(self, job: JobContext, model: nn.Module, log: logging.LoggerAdapter,
                 static: StaticDecoder | None = None):
        self.cfg = job.config.rollout.medusa
        self.log = log
        self.static = static
        """Static caches (and CUDA graphs) for both modes (`rollout.decode`); None: eager."""
        self.heads = load_rollout_heads(job.checkpoint, model, self.cfg.heads).eval().to(
            next(model.parameters()).device)
        self.store = WeightStore(job.weights_root, "medusa")
        self.heads_version = 0
        self.heads_backbone = 0
        """The policy version the heads were trained against (0: the warm start's heads)."""
        self.speculative = True
        """The mode in use (the other one runs every probe_every-th mini-batch)."""
        self.seconds_per_token: dict[bool, float] = {}
        self.minibatches = 0

    def generate(self, model: nn.Module, prompts: list[Tensor], params: SamplingParams,
                 generator: torch.Generator, policy_version: int) -> tuple[Generation, dict[str, int | str]]:
        self._refresh()
        lag = policy_version - self.heads_backbone
        self.minibatches += 1
        probe = self.minibatches % self.cfg.probe_every == 0
        speculative = (self.speculative != probe) and lag <= self.cfg.max_lag
        started = time.perf_counter()
        info: dict[str, int | str] = {"medusa_lag": lag, "decoding": "speculative" if speculative else "plain"}
        if speculative:
            with torch.inference_mode():
                if self.static is None:
                    gen, stats = generate_speculative(model, self.heads, prompts, params, generator)
                else:
                    gen, stats = generate_speculative_static(model, self.heads, self.static, prompts, params,
                                                             generator)
            info.update(spec_steps=stats.verify_steps, spec_row_steps=stats.row_steps,
                        spec_accepted=stats.drafts_accepted)
        else:
            gen = sample(model, prompts, params, generator, static=self.static)
        tokens = sum(len(r) for r in gen.response_ids)
        if lag <= self.cfg.max_lag:
            self._time(speculative, (time.perf_counter() - started) / max(tokens, 1))
        return gen, info

    def _refresh(self) -> None:
        if not self.cfg.companion:
            return
        version = self.store.refresh(self.heads, self.heads_version)
        if version != self.heads_version:
            try:
                self.heads_backbone = int(self.store.metadata(version)["backbone_version"])
            except FileNotFoundError:  # replaced meanwhile: the next mini-batch loads the newer one
                return
            self.heads_version = version

    def _time(self, speculative: bool, seconds_per_token: float) -> None:
        old = self.seconds_per_token.get(speculative)
        self.seconds_per_token[speculative] = (seconds_per_token if old is None
                                               else SMOOTHING * seconds_per_token + (1 - SMOOTHING) * old)
        if len(self.seconds_per_token) < 2:
            return
        faster = self.seconds_per_token[True] < self.seconds_per_token[False]
        if faster != self.speculative:
            self.speculative = faster
            self.log.info("speculative decoding %s: %.2f ms/token speculative, %.2f plain",
                          "back on" if faster else "off (slower than plain)",
                          1e3 * self.seconds_per_token[True], 1e3 * self.seconds_per_token[False])
