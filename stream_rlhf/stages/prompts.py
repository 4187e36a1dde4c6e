"""The prompt source: `iterations * minibatches` mini-batches of task prompts for rollout.

Each prompt appears `samples_per_prompt` times in its mini-batch with one group id, so GRPO and
RLOO find a prompt's samples together. References (the answers the reward checks) travel as
handle metadata.
"""

from __future__ import annotations

import torch

from stream_rlhf.broker.stage import Batch, Output, Stage, StageContext
from stream_rlhf.data.arithmetic import problems
from stream_rlhf.models.checkpoint import load_tokenizer
from stream_rlhf.stages.job_context import JobContext
from stream_rlhf.stages.samples import ragged


class PromptSource(Stage):
    def __init__(self, job: JobContext):
        self.job = job
        cfg = job.config
        self.order = [(i, m) for i in range(cfg.iterations) for m in range(cfg.rollout_batch.minibatches)]
        count = len(self.order) * cfg.rollout_batch.prompts_per_minibatch
        self.problems = problems("train", count, cfg.task.seed, cfg.task.max_operand)

    def setup(self, ctx: StageContext) -> None:
        super().setup(ctx)
        self.tokenizer = load_tokenizer(self.job.checkpoint)

    def step(self, batch: Batch | None) -> list[Output] | None:
        if not self.order:
            return None
        iteration, minibatch = self.order.pop(0)
        rb = self.job.config.rollout_batch
        first = (iteration * rb.minibatches + minibatch) * rb.prompts_per_minibatch
        chosen = self.problems[first:first + rb.prompts_per_minibatch]
        prompt_ids, references, group_ids = [], [], []
        for k, problem in enumerate(chosen):
            ids = torch.tensor([self.tokenizer.bos_token_id, *self.tokenizer.encode(problem.prompt, add_special_tokens=False)])
            for _ in range(rb.samples_per_prompt):
                prompt_ids.append(ids)
                references.append(problem.answer)
                group_ids.append(first + k)
        tensors = {**ragged("prompt_ids", prompt_ids), "group_ids": torch.tensor(group_ids)}
        return [Output("prompts", tensors, len(prompt_ids), iteration, minibatch, policy_version=0,
                       metadata={"references": references})]
