"""Evaluation of a checkpoint on the task's held-out prompts: mean reward of sampled responses
(at the rollout temperature: the quantity RL maximises) and of greedy ones.

    evaluate(cfg, checkpoint)  -> {"reward": 0.42, "greedy_reward": 0.55}
"""

from __future__ import annotations

import torch

from stream_rlhf.backends.torch_rollout import SamplingParams, generate
from stream_rlhf.data.arithmetic import problems
from stream_rlhf.models.checkpoint import load_policy, load_tokenizer, stop_token_ids
from stream_rlhf.rl.config import RLJobConfig
from stream_rlhf.stages.job_context import JobContext, seeded_generator
from stream_rlhf.stages.reward_forward import Scorer
from stream_rlhf.stages.samples import Rollout


def evaluate(cfg: RLJobConfig, checkpoint: str, batch_size: int = 128) -> dict[str, float]:
    tokenizer = load_tokenizer(checkpoint)
    model = load_policy(checkpoint).eval()
    scorer = Scorer(JobContext(cfg, checkpoint, ""))
    eval_set = problems("eval", cfg.task.eval_prompts, cfg.task.seed, cfg.task.max_operand)
    stop_ids = stop_token_ids(tokenizer, cfg.rollout.stop)
    result = {}
    for name, temperature in (("reward", cfg.rollout.temperature), ("greedy_reward", 0.0)):
        params = SamplingParams(temperature, cfg.rollout.top_p, cfg.rollout.max_new_tokens, stop_ids, tokenizer.pad_token_id)
        scores = []
        for first in range(0, len(eval_set), batch_size):
            chunk = eval_set[first:first + batch_size]
            prompts = [torch.tensor([tokenizer.bos_token_id, *tokenizer.encode(p.prompt, add_special_tokens=False)])
                       for p in chunk]
            gen = generate(model, prompts, params, seeded_generator(cfg.seed, "eval", first))
            rollout = Rollout([torch.cat([p, r]) for p, r in zip(prompts, gen.response_ids)],
                              torch.tensor([len(p) for p in prompts]), gen.response_logp, torch.zeros(len(chunk)))
            scores.append(scorer.score(rollout, [p.answer for p in chunk]))
        result[name] = round(torch.cat(scores).mean().item(), 4)
    return result
