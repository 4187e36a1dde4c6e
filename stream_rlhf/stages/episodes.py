"""The rollout stage's multi-turn side (`env` jobs): a mini-batch's samples run as episodes in the
configured environment, and come back as the rollout handle's fields.

    episodes = EpisodeRollout(job, tokenizer, params, engine, counts, log)
    tensors, policy_version, metadata = episodes.generate(batch, prompts, images)   # one mini-batch
    episodes.begin(batch, prompts, images)          # or several in flight (env.minibatches_in_flight)
    for batch, tensors, policy_version, metadata in episodes.advance(): ...
    episodes.close()

The episodes' policy turns come from the rollout engine's `turn_sampler` (`envs/turns.py`), the
environment calls run on the `EnvStepper`'s thread, and `envs/episode_loop.py` drives both. Under
`env.schedule: stream` the episodes of up to `env.minibatches_in_flight` mini-batches share one
sampler (slots for that many mini-batches): while one mini-batch's episodes wait for their tools,
the sampler decodes the next one's, and each mini-batch is handed back as soon as its own
episodes have ended. A mini-batch that does not fit (no free slots, or prompts longer than the
open sampler's slots hold) waits for room; with nothing in flight the sampler is made anew. The
handle holds, per sample, the prompt and every token after it (policy turns and observations) with
`loss_mask`, `env_rewards` and `token_versions` (`envs/episode_handle.py`), and the metadata
"episodes": turns, tool calls, tool seconds and why each episode ended (`telemetry/episodes.py`).

With `env.processes` the environments live in worker processes of their own (`envs/process_envs.py`;
the loop, the stepper and those processes are `envs/episode_runtime.py`'s, as for evaluation).

A vision-language job's observations may show images (`envs/observation_images.py`): they are read
and patched as the dataset's images are (the model folder's preprocessor settings, `data.min_pixels`
/ `data.max_pixels`) and encoded by the rollout engine's own vision tower (`encode_images`: the
torch engine holds the whole policy, vLLM's rollout loads the frozen tower at the first such image;
a mid-episode image needs no round trip through the vision stage, and each image is still encoded
once); the handle carries them after the prompt's images.
"""

from __future__ import annotations

import json
import logging
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from transformers import AutoConfig, PreTrainedTokenizerBase

from stream_rlhf.backends.episode_sampler import episode_capacity
from stream_rlhf.backends.rollout_engine import RolloutEngine
from stream_rlhf.backends.torch_rollout import SamplingParams
from stream_rlhf.data.images import ImageSpec
from stream_rlhf.envs.environment import EpisodeStart
from stream_rlhf.envs.episode_handle import episode_tensors
from stream_rlhf.envs.episode_loop import EpisodeResult
from stream_rlhf.envs.episode_runtime import EpisodeRuntime
from stream_rlhf.envs.observation_images import ObservationImages
from stream_rlhf.envs.turns import TurnSampler
from stream_rlhf.samples import SampleImages
from stream_rlhf.seeding import rollout_seed
from stream_rlhf.stage import Batch
from stream_rlhf.stages.job_context import JobContext
from stream_rlhf.stages.topics import REWARD_KWARGS
from stream_rlhf.telemetry.episodes import CLOSES_FAILED, EPISODES, FAILED, PROCESSES_REPLACED, EpisodeStats
from stream_rlhf.telemetry.sample_log import IMAGE_PATHS
from stream_rlhf.telemetry.stage_counts import StageCounts

MAX_FAILURES_LOGGED = 3
"""Failed episodes whose message a mini-batch logs (all are counted, in summary.json)."""


@dataclass(frozen=True)
class _Waiting:
    """A mini-batch begun whose episodes have not joined the sampler yet."""

    batch: Batch
    prompts: list[Tensor]
    images: list[SampleImages] | None


class EpisodeRollout:
    """Runs mini-batches' episodes, several at once under `stream` (env.minibatches_in_flight);
    one per rollout instance (its stepper thread lives with it)."""

    def __init__(self, job: JobContext, tokenizer: PreTrainedTokenizerBase, params: SamplingParams,
                 engine: RolloutEngine, counts: StageCounts, log: logging.LoggerAdapter):
        """`counts`: the rollout stage's, where failed environment closes are counted."""
        cfg = job.config.env
        if cfg is None:
            raise ValueError("EpisodeRollout: the job has no env section")
        self.tokenizer, self.params, self.engine, self.counts, self.log = tokenizer, params, engine, counts, log
        self.max_episode_tokens = cfg.max_episode_tokens
        self.mask_failed = cfg.failed_episodes == "mask"
        self.seed = job.config.seed
        self.in_flight = cfg.minibatches_in_flight if cfg.schedule == "stream" else 1
        """Mini-batches whose episodes run at once (the rollout stage's inputs in flight)."""
        batch = job.config.rollout_batch
        threads = cfg.threads(batch.prompts_per_minibatch * batch.samples_per_prompt * self.in_flight)
        self.runtime = EpisodeRuntime(cfg, threads, tokenizer, job.config.data.chat_template, params.max_new_tokens)
        self.replaced = 0
        """Environment processes replaced, as counted so far."""
        self.sampler: TurnSampler | None = None
        self.capacity = 0
        """Positions per slot of the open sampler."""
        self.waiting: deque[_Waiting] = deque()
        self.image_spec: ImageSpec | None = None
        self.vision_token_ids: tuple[int, int, int] | None = None
        if job.vision_language:  # as the prompt dataset reads its images (rl/task_data.py)
            model = AutoConfig.from_pretrained(job.checkpoint)
            data = job.config.data
            self.image_spec = ImageSpec.from_model_folder(job.config.model.path, model.vision_config,
                                                          data.min_pixels, data.max_pixels)
            self.vision_token_ids = (model.vision_start_token_id, model.image_token_id, model.vision_end_token_id)

    @property
    def busy(self) -> bool:
        """Whether a mini-batch begun has not ended yet."""
        return bool(self.waiting or self.runtime.loop.groups)

    def generate(self, batch: Batch, prompts: list[Tensor],
                 images: list[SampleImages] | None) -> tuple[dict[str, Tensor], int, dict[str, Any]]:
        """`batch`'s episodes, begun and run to their ends: its handle (see `advance`)."""
        self.begin(batch, prompts, images)
        while not (ended := self.advance()):
            pass
        return ended[0][1:]

    def begin(self, batch: Batch, prompts: list[Tensor], images: list[SampleImages] | None) -> None:
        """`batch`'s episodes join the sampler now, or once it has room for them."""
        self.waiting.append(_Waiting(batch, prompts, images))
        self._admit()

    def advance(self) -> list[tuple[Batch, dict[str, Tensor], int, dict[str, Any]]]:
        """Some work on the episodes in flight; the mini-batches whose episodes have all ended, each
        with its handle's tensors, its policy version (the oldest that sampled a token) and its
        metadata ("finished": the episodes the environment ended; the episode figures)."""
        ended = [(tag, *self._handle(tag, result)) for tag, result in self.runtime.loop.advance()]
        if not self.runtime.loop.groups and self.sampler is not None:
            self.sampler.close()
            self.sampler = None
        self._admit()
        return ended

    def _admit(self) -> None:
        """Waiting mini-batches join, in order, while the sampler has slots and positions for them;
        with nothing in flight, a fresh sampler sized for `in_flight` of the first."""
        while self.waiting:
            first = self.waiting[0]
            capacity = episode_capacity(first.prompts, self.params.max_new_tokens, self.max_episode_tokens)
            if self.sampler is None:
                slots = len(first.prompts) * self.in_flight
                self.sampler = self.engine.turn_sampler(first.batch, self.params, slots, capacity)
                self.capacity = capacity
                self.runtime.loop.open(self.sampler, self.runtime.stepper, self._observe(), slots)
            elif self.runtime.loop.free_slots >= len(first.prompts) and capacity <= self.capacity:
                self.engine.join_turns(self.sampler, first.batch)
            else:
                return
            self.waiting.popleft()
            self.runtime.loop.add(first.batch, self._starts(first.batch, first.prompts), first.prompts, first.images,
                          rollout_seed(self.seed, first.batch.iteration, first.batch.minibatch))

    def _handle(self, batch: Batch, result: EpisodeResult) -> tuple[dict[str, Tensor], int, dict[str, Any]]:
        for failure in result.failures[:MAX_FAILURES_LOGGED]:
            self.log.warning("iteration %d mini-batch %d: %s", batch.iteration, batch.minibatch, failure)
        self._count_env_events(self.runtime.stepper.close_failures())
        tensors = episode_tensors(result.episodes)
        tensors["truncated"] = torch.tensor([ended == "max_episode_tokens" for ended in result.ended])
        if self.mask_failed:  # their tokens carry no loss (experience.py)
            tensors["trained"] = torch.tensor([not ended.startswith(FAILED) for ended in result.ended])
        versions = [v for episode in result.episodes for v, m in zip(episode.policy_versions, episode.loss_mask) if m]
        finished = sum(ended == "done" for ended in result.ended)
        metadata = {"finished": finished, EPISODES: EpisodeStats.of(result).encode()}
        if any(episode.observation_image_paths for episode in result.episodes):  # the prompt's, then the observations'
            prompt_paths = batch.metadata.get(IMAGE_PATHS) or [""] * len(result.episodes)
            metadata[IMAGE_PATHS] = ["\n".join([p for p in paths.split("\n") if p] + episode.observation_image_paths)
                                     for paths, episode in zip(prompt_paths, result.episodes, strict=True)]
        return tensors, min(versions), metadata

    def _count_env_events(self, failures: list[str]) -> None:
        """Counts the environment closes that failed, `failures` (and logs the first few), and the
        environment processes started since the last call to replace others."""
        for failure in failures[:MAX_FAILURES_LOGGED]:
            self.log.warning("an environment's close failed: %s", failure)
        if failures:
            self.counts.add(**{CLOSES_FAILED: len(failures)})
        replaced = self.runtime.processes_replaced
        if replaced > self.replaced:
            self.counts.add(**{PROCESSES_REPLACED: replaced - self.replaced})
            self.replaced = replaced

    def _observe(self) -> ObservationImages | None:
        """How observations' images become ids and features (None for a text model)."""
        if self.image_spec is None or self.vision_token_ids is None:
            return None
        return ObservationImages(self.tokenizer, self.image_spec, self.vision_token_ids, self.engine.encode_images)

    def _starts(self, batch: Batch, prompts: list[Tensor]) -> list[EpisodeStart]:
        paths = batch.metadata.get(IMAGE_PATHS) or [""] * len(prompts)
        return [EpisodeStart(prompt=self.runtime.decode(prompt.tolist()), reference=reference,
                             images=tuple(path.split("\n")) if path else (), fields=json.loads(kwargs))
                for prompt, reference, kwargs, path in zip(prompts, batch.metadata["references"],
                                                           batch.metadata[REWARD_KWARGS], paths, strict=True)]

    def close(self) -> None:
        """Stops: the environments of episodes still in flight are closed, every close's failure
        is counted, and the environment processes end."""
        if self.sampler is not None:
            self.sampler.close()
        self._count_env_events(self.runtime.close())

