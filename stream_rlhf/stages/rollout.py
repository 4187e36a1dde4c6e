"""Rollout: samples responses from the current policy, with the torch KV-cache backend or vLLM.

Before each mini-batch it loads the newest actor weights the trainer published (with
`weights.update: in_flight` vLLM also takes them between engine steps; `stages/rollout_vllm.py`),
and every output carries the `policy_version` that generated it along with the behaviour
log-probs of the sampled tokens; the two backends give the same fields. A vision-language model
reads the image features of its input handle (the vision stage's; `stages/images.py`). With
`rollout.medusa` enabled, decoding is speculative with Medusa heads where that is faster
(`stages/speculation.py`).
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor

from stream_rlhf.backends.torch_rollout import Generation, SamplingParams, generate
from stream_rlhf.backends.vllm_rollout import VllmGeneration
from stream_rlhf.broker.stage import Batch, Output, Stage, StageContext
from stream_rlhf.models.checkpoint import load_policy, load_tokenizer, max_positions, stop_token_ids
from stream_rlhf.stages.images import ImageInputs
from stream_rlhf.stages.job_context import JobContext, seeded_generator
from stream_rlhf.stages.samples import Rollout, ragged, unragged
from stream_rlhf.stages.speculation import Speculation
from stream_rlhf.stages.weight_sync import RolloutWeights
from stream_rlhf.telemetry.stage_counts import StageCounts


class TorchBackend:
    """Our KV-cache sampler (optionally speculative) over the policy model in this process."""

    def __init__(self, job: JobContext, weights: RolloutWeights, images: ImageInputs, log: logging.LoggerAdapter,
                 device: torch.device):
        self.job = job
        self.weights = weights
        self.images = images
        self.device = device
        self.model = load_policy(job.checkpoint).eval().to(device)
        self.policy_version = 0
        weights.join_model(self.model)
        medusa = job.config.rollout.medusa.enabled
        self.speculation = Speculation(job, self.model, log) if medusa else None

    def generate(self, batch: Batch, prompts: list[Tensor],
                 params: SamplingParams) -> tuple[Generation, int, dict[str, int | str]]:
        self.policy_version = self.weights.refresh_model(self.model, self.policy_version)
        generator = seeded_generator(self.job.config.seed, "rollout", batch.iteration, batch.minibatch,
                                     device=self.device)
        if self.speculation is not None:
            gen, info = self.speculation.generate(self.model, prompts, params, generator, self.policy_version)
            return gen, self.policy_version, info
        gen = generate(self.model, prompts, params, generator, images=self.images.of(batch.tensors))
        return gen, self.policy_version, {}

    def close(self) -> None:
        pass


class RolloutStage(Stage):
    def __init__(self, job: JobContext):
        self.job = job

    def setup(self, ctx: StageContext) -> None:
        super().setup(ctx)
        cfg = self.job.config.rollout
        tokenizer = load_tokenizer(self.job.checkpoint)
        stop_ids = stop_token_ids(tokenizer, cfg.stop)
        self.params = SamplingParams(cfg.temperature, cfg.top_p, cfg.max_new_tokens, stop_ids, tokenizer.pad_token_id)
        # generated = trained + dropped + in flight at stop, in the summary; per process on disk,
        # so a restarted instance adds to the count
        self.counts = StageCounts(self.job.run_dir, ctx.stage, ctx.instance_id)
        self.weights = RolloutWeights(self.job, ctx.instance_id)
        images = ImageInputs(self.job, self.counts, ctx.group.device)
        if cfg.backend == "vllm":
            from stream_rlhf.stages.rollout_vllm import VllmBackend

            self.backend = VllmBackend(self.job, self.weights, max_positions(self.job.checkpoint), images,
                                       ctx.stopping)
        else:
            self.backend = TorchBackend(self.job, self.weights, images, ctx.log, ctx.group.device)

    def on_weights(self, version: int) -> None:
        self.weights.announced = max(self.weights.announced, version)

    def step(self, batch: Batch | None) -> list[Output]:
        prompts = unragged(batch.tensors, "prompt_ids")
        gen, policy_version, info = self.backend.generate(batch, prompts, self.params)
        rollout = Rollout(
            sequences=[torch.cat([p, r]) for p, r in zip(prompts, gen.response_ids)],
            prompt_lens=torch.tensor([len(p) for p in prompts], dtype=torch.int32),
            behavior_logp=gen.response_logp,
            group_ids=batch.tensors["group_ids"],
        )
        self.counts.add(generated=len(prompts))
        finished = sum(reason == "stop" for reason in gen.finish_reasons)
        tensors = rollout.to_tensors()
        if isinstance(gen, VllmGeneration) and self.job.config.weights.update == "in_flight":
            tensors.update(ragged("token_versions", gen.token_versions))  # (R_i,) version per token
        if self.job.vision_language:
            del tensors["group_ids"]  # the image handle the broker joins with this one carries them
        return [Output("rollout", tensors, len(prompts), policy_version=policy_version,
                       metadata={"references": batch.metadata["references"], "finished": finished, **info})]

    def close(self) -> None:
        self.backend.close()
        self.weights.close()
