"""The prompt source: `iterations * minibatches` mini-batches of prompts for rollout.

Prompts come from a text task made in memory (arithmetic, tool_sums) or from a JSONL dataset (`data.train`, or
the files of the `shapes` task), cycled epoch after epoch in a seeded order. Images are decoded
and cut into patches here, once per prompt (`stages/images.py` has the handle's image fields).
Each prompt appears `samples_per_prompt` times in its mini-batch with one group id, so GRPO and
RLOO find a prompt's samples together; its images are shared by those samples. References (the
answers the reward checks) and the reward function's extra keyword arguments (`data.fields`, as
one JSON text per sample) travel as handle metadata. Lines the dataset skips
(`data.on_bad_sample: skip`) are counted in `stage_counts/` for the summary. The dataset's
cursor is recorded at every iteration's start (`prompt_cursor.py`), and a resumed run starts
at its checkpoint's iteration from there.
"""

from __future__ import annotations

import json

import torch
from transformers import AutoConfig

from stream_rlhf.data.text_tasks import problems
from stream_rlhf.data.tokenizer import load_tokenizer
from stream_rlhf.rl.task_data import open_prompts
from stream_rlhf.samples import ragged
from stream_rlhf.stage import Batch, Output, Stage, StageContext
from stream_rlhf.stages.images import image_batch_fields
from stream_rlhf.stages.job_context import JobContext
from stream_rlhf.stages.prompt_cursor import PromptCursors
from stream_rlhf.stages.topics import REWARD_KWARGS, topic_output
from stream_rlhf.telemetry.sample_log import IMAGE_PATHS
from stream_rlhf.telemetry.stage_counts import StageCounts


class PromptSource(Stage):
    def __init__(self, job: JobContext):
        self.job = job
        cfg = job.config
        start = job.start_iteration  # a resumed run serves the iterations its checkpoint had not trained
        self.order = [(i, m) for i in range(start, cfg.iterations) for m in range(cfg.rollout_batch.minibatches)]

    def setup(self, ctx: StageContext) -> None:
        super().setup(ctx)
        cfg = self.job.config
        self.tokenizer = load_tokenizer(self.job.checkpoint)
        model_config = AutoConfig.from_pretrained(self.job.checkpoint)
        self.dataset = open_prompts(cfg, model_config, self.tokenizer, "train", cfg.seed)
        if self.dataset is None:
            count = cfg.iterations * cfg.rollout_batch.minibatches * cfg.rollout_batch.prompts_per_minibatch
            self.problems = problems(cfg.task, "train", count, cfg.task.seed)
        self.cursors = PromptCursors(self.job.run_dir)
        if self.dataset is not None and self.job.start_iteration:
            self.dataset.seek(self.cursors.at(self.job.start_iteration))
        self.counts = StageCounts(self.job.run_dir, ctx.stage, ctx.instance_id)

    def step(self, batch: Batch | None) -> list[Output] | None:
        if not self.order:
            return None
        iteration, minibatch = self.order.pop(0)
        if minibatch == 0 and self.dataset is not None:
            self.cursors.record(iteration, self.dataset.cursor())
        rb = self.job.config.rollout_batch
        first = (iteration * rb.minibatches + minibatch) * rb.prompts_per_minibatch
        prompts, references, reward_kwargs, images, prompt_images, image_paths = [], [], [], [], [], []
        for _ in range(rb.prompts_per_minibatch):
            ids, reference, kwargs, own_images, own_paths = self._next_prompt(first + len(prompts))
            prompts.append(ids)
            references.append(reference)
            reward_kwargs.append(kwargs)
            image_paths.append("\n".join(own_paths))
            prompt_images.append(list(range(len(images), len(images) + len(own_images))))
            images += own_images
        repeat = rb.samples_per_prompt
        tensors = {
            **ragged("prompt_ids", [p for p in prompts for _ in range(repeat)]),
            "group_ids": torch.arange(first, first + len(prompts)).repeat_interleave(repeat),
        }
        metadata = {"references": [r for r in references for _ in range(repeat)],
                    REWARD_KWARGS: [json.dumps(k) for k in reward_kwargs for _ in range(repeat)]}  # wire: scalars
        if self.job.vision_language:
            tensors.update(image_batch_fields(images, [ix for ix in prompt_images for _ in range(repeat)]))
            metadata[IMAGE_PATHS] = [p for p in image_paths for _ in range(repeat)]  # for the sample log
        self._count(len(images) * repeat)
        return [topic_output("prompts", tensors, len(prompts) * repeat, iteration, minibatch, policy_version=0,
                       metadata=metadata)]

    def _next_prompt(self, index: int) -> tuple[torch.Tensor, str, dict, list, tuple[str, ...]]:
        """(prompt ids, reference, the reward function's extra keyword arguments, decoded images,
        their names) of the next prompt."""
        if self.dataset is None:
            problem = self.problems[index]
            ids = [self.tokenizer.bos_token_id, *self.tokenizer.encode(problem.prompt, add_special_tokens=False)]
            return torch.tensor(ids), problem.answer, {}, [], ()
        sample = self.dataset.next_sample()
        return sample.prompt_ids, sample.answer, sample.reward_kwargs, sample.images, sample.image_paths

    def _count(self, images: int) -> None:
        self.counts.add(images_seen=images)
        if self.dataset is not None and self.dataset.skipped:
            self.counts.set_details(skipped=self.dataset.skipped, skipped_examples=self.dataset.skipped_examples)
