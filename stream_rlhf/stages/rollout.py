"""Rollout: samples responses from the current policy with the torch KV-cache backend.

Before each mini-batch it loads the newest actor weights the trainer published (weights change
only between mini-batches), and every output carries the `policy_version` that generated it
along with the behaviour log-probs of the sampled tokens. A vision-language model reads the image
features of its input handle (the vision stage's; `stages/images.py`). With `rollout.medusa`
enabled, decoding is speculative with Medusa heads where that is faster (`stages/speculation.py`).
"""

from __future__ import annotations

import torch

from stream_rlhf.backends.torch_rollout import SamplingParams, generate
from stream_rlhf.broker.stage import Batch, Output, Stage, StageContext
from stream_rlhf.models.checkpoint import load_policy, load_tokenizer, stop_token_ids
from stream_rlhf.stages.images import ImageInputs
from stream_rlhf.stages.job_context import JobContext, seeded_generator
from stream_rlhf.stages.samples import Rollout, unragged
from stream_rlhf.stages.speculation import Speculation
from stream_rlhf.telemetry.stage_counts import StageCounts
from stream_rlhf.weights.shm_store import WeightStore


class RolloutStage(Stage):
    def __init__(self, job: JobContext):
        self.job = job
        self.policy_version = 0

    def setup(self, ctx: StageContext) -> None:
        super().setup(ctx)
        cfg = self.job.config.rollout
        self.tokenizer = load_tokenizer(self.job.checkpoint)
        self.model = load_policy(self.job.checkpoint).eval()
        self.weights = WeightStore(self.job.weights_root, "actor")
        stop_ids = stop_token_ids(self.tokenizer, cfg.stop)
        self.params = SamplingParams(cfg.temperature, cfg.top_p, cfg.max_new_tokens, stop_ids,
                                     self.tokenizer.pad_token_id)
        # generated = trained + dropped + in flight at stop, in the summary; per process on disk,
        # so a restarted instance adds to the count
        self.counts = StageCounts(self.job.run_dir, ctx.stage, ctx.instance_id)
        self.images = ImageInputs(self.job, self.counts)
        self.speculation = Speculation(self.job, self.model, ctx.log) if cfg.medusa.enabled else None

    def step(self, batch: Batch | None) -> list[Output]:
        self.policy_version = self.weights.refresh(self.model, self.policy_version)
        prompts = unragged(batch.tensors, "prompt_ids")
        generator = seeded_generator(self.job.config.seed, "rollout", batch.iteration, batch.minibatch)
        info = {}
        if self.speculation is not None:
            gen, info = self.speculation.generate(self.model, prompts, self.params, generator, self.policy_version)
        else:
            gen = generate(self.model, prompts, self.params, generator, images=self.images.of(batch.tensors))
        rollout = Rollout(
            sequences=[torch.cat([p, r]) for p, r in zip(prompts, gen.response_ids)],
            prompt_lens=torch.tensor([len(p) for p in prompts], dtype=torch.int32),
            behavior_logp=gen.response_logp,
            group_ids=batch.tensors["group_ids"],
        )
        self.counts.add(generated=len(prompts))
        finished = sum(reason == "stop" for reason in gen.finish_reasons)
        tensors = rollout.to_tensors()
        if self.job.vision_language:
            del tensors["group_ids"]  # the image handle the broker joins with this one carries them
        return [Output("rollout", tensors, len(prompts), policy_version=self.policy_version,
                       metadata={"references": batch.metadata["references"], "finished": finished, **info})]
