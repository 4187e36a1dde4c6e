"""The rollout stage's multi-turn side (`env` jobs): a mini-batch's samples run as episodes in the
configured environment, and come back as the rollout handle's fields.

    episodes = EpisodeRollout(job, tokenizer, max_new_tokens)
    tensors, policy_version, metadata = episodes.generate(batch, prompts, images, engine, params)
    episodes.close()

The episodes' policy turns come from the rollout engine's `turn_sampler` (`envs/turns.py`), the
environment calls run on the `EnvStepper`'s thread, and `envs/episode_loop.py` drives both. The
handle holds, per sample, the prompt and every token after it (policy turns and observations) with
`loss_mask`, `env_rewards` and `token_versions` (`envs/episode_handle.py`), and the metadata
"episodes": turns, tool calls, tool seconds and why each episode ended (`telemetry/episodes.py`).

A vision-language job's observations may show images (`envs/observation_images.py`): they are read
and patched as the dataset's images are (the model folder's preprocessor settings, `data.min_pixels`
/ `data.max_pixels`) and encoded by the rollout engine's own vision tower (`encode_images`: the
torch engine holds the whole policy, so a mid-episode image needs no round trip through the vision
stage, and each image is still encoded once); the handle carries them after the prompt's images.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from torch import Tensor
from transformers import AutoConfig, PreTrainedTokenizerBase

from stream_rlhf.backends.rollout_engine import RolloutEngine
from stream_rlhf.backends.torch_rollout import SamplingParams
from stream_rlhf.data.images import ImageSpec
from stream_rlhf.envs.environment import EpisodeStart
from stream_rlhf.envs.episode_handle import episode_tensors
from stream_rlhf.envs.episode_loop import EpisodeLoop
from stream_rlhf.envs.observation_images import ObservationImages
from stream_rlhf.envs.stepper import EnvStepper
from stream_rlhf.samples import SampleImages
from stream_rlhf.stage import Batch
from stream_rlhf.stages.job_context import JobContext
from stream_rlhf.stages.topics import REWARD_KWARGS
from stream_rlhf.telemetry.episodes import EPISODES, EpisodeStats
from stream_rlhf.telemetry.sample_log import IMAGE_PATHS

MAX_FAILURES_LOGGED = 3
"""Failed episodes whose message a mini-batch logs (all are counted, in summary.json)."""


class EpisodeRollout:
    """Runs each mini-batch's episodes; one per rollout instance (its stepper thread lives with it)."""

    def __init__(self, job: JobContext, tokenizer: PreTrainedTokenizerBase, max_new_tokens: int,
                 log: logging.LoggerAdapter):
        cfg = job.config.env
        if cfg is None:
            raise ValueError("EpisodeRollout: the job has no env section")
        self.tokenizer = tokenizer
        self.log = log
        self.loop = EpisodeLoop(cfg, self._decode, self._encode, max_new_tokens)
        self.stepper = EnvStepper(cfg.step_timeout_s, cfg.workers)
        self.image_spec: ImageSpec | None = None
        self.vision_token_ids: tuple[int, int, int] | None = None
        if job.vision_language:  # as the prompt dataset reads its images (rl/task_data.py)
            model = AutoConfig.from_pretrained(job.checkpoint)
            data = job.config.data
            self.image_spec = ImageSpec.from_model_folder(job.config.model.path, model.vision_config,
                                                          data.min_pixels, data.max_pixels)
            self.vision_token_ids = (model.vision_start_token_id, model.image_token_id, model.vision_end_token_id)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def generate(self, batch: Batch, prompts: list[Tensor], images: list[SampleImages] | None,
                 engine: RolloutEngine, params: SamplingParams) -> tuple[dict[str, Tensor], int, dict[str, Any]]:
        """The rollout handle's tensors, its policy version (the oldest that sampled a token) and
        its metadata ("finished": the episodes the environment ended; the episode figures), for
        the samples of `batch`."""
        starts = self._starts(batch, prompts)
        sampler = engine.turn_sampler(batch, params)
        try:
            result = self.loop.run(starts, prompts, images, sampler, self.stepper, self._observe(engine))
        finally:
            sampler.close()
        for failure in result.failures[:MAX_FAILURES_LOGGED]:
            self.log.warning("iteration %d mini-batch %d: %s", batch.iteration, batch.minibatch, failure)
        tensors = episode_tensors(result.episodes)
        versions = [v for episode in result.episodes for v, m in zip(episode.policy_versions, episode.loss_mask) if m]
        finished = sum(ended == "done" for ended in result.ended)
        return tensors, min(versions), {"finished": finished, EPISODES: EpisodeStats.of(result).encode()}

    def _observe(self, engine: RolloutEngine) -> ObservationImages | None:
        """How observations' images become ids and features (None for a text model)."""
        if self.image_spec is None or self.vision_token_ids is None:
            return None
        return ObservationImages(self.tokenizer, self.image_spec, self.vision_token_ids, engine.encode_images)

    def _starts(self, batch: Batch, prompts: list[Tensor]) -> list[EpisodeStart]:
        paths = batch.metadata.get(IMAGE_PATHS) or [""] * len(prompts)
        return [EpisodeStart(prompt=self._decode(prompt.tolist()), reference=reference,
                             images=tuple(path.split("\n")) if path else (), fields=json.loads(kwargs))
                for prompt, reference, kwargs, path in zip(prompts, batch.metadata["references"],
                                                           batch.metadata[REWARD_KWARGS], paths, strict=True)]

    def close(self) -> None:
        self.stepper.close()

