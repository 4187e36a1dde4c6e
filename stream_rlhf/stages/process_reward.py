"""Process rewards of a generated mini-batch: one score per step, placed on the step's end token.

    scorer = ProcessScorer(cfg.reward.process, tokenizer)
    per_token = scorer.rewards(rollout, references)   # [(R_i,) float]: weight * step score at each
                                                      # step's end token, 0 elsewhere

The steps are cut at the separator token (`algos/process_rewards.py`). A rule function gets each
step's text and returns one score per step; a PRM (token classification, one label) scores each
step by sigmoid(logit) at its end token, having read the prompt and the response up to there.
`separator_id` is also the config check the driver runs before the warm start: a separator the
tokenizer cannot write as one token, or a PRM with another vocabulary, fails naming the key.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor
from transformers import PreTrainedTokenizerBase

from stream_rlhf.algos.process_rewards import place_step_rewards, step_ends, step_spans
from stream_rlhf.backends.forward_engine import ProcessRewardEngine
from stream_rlhf.config import ConfigError, import_dotted
from stream_rlhf.data.tokenizer import load_tokenizer
from stream_rlhf.rl.reward_parts_config import ProcessRewardConfig
from stream_rlhf.rl.reward_pool import STEPS, Call, RewardPool, log_timeouts
from stream_rlhf.samples import Rollout

StepFunction = Callable[[str, list[str], str], list[float]]
KEY = "reward.process"


def separator_id(tokenizer: PreTrainedTokenizerBase, separator: str) -> int:
    """The one token id that writes `separator`; a ConfigError naming reward.process.separator when
    the tokenizer has no such token (unknown, or several tokens)."""
    ids = tokenizer.encode(separator, add_special_tokens=False)
    if len(ids) != 1 or ids[0] == tokenizer.unk_token_id or tokenizer.decode(ids) != separator:
        pieces = tokenizer.convert_ids_to_tokens(ids)
        raise ConfigError(f"{KEY}.separator={separator!r}: the policy's tokenizer writes it as {pieces} "
                          "(a step separator must be exactly one token of it)")
    return ids[0]


def check_process_reward(cfg: ProcessRewardConfig, tokenizer: PreTrainedTokenizerBase) -> None:
    """The separator is one token, and a PRM reads the policy's token ids (the same vocabulary)."""
    separator_id(tokenizer, cfg.separator)
    if cfg.model_path is None:
        return
    if load_tokenizer(cfg.model_path).get_vocab() != tokenizer.get_vocab():
        raise ConfigError(f"{KEY}.model_path={cfg.model_path!r}: its tokenizer differs from the policy's (a PRM "
                          "scores the policy's token ids)")


class ProcessScorer:
    def __init__(self, cfg: ProcessRewardConfig, tokenizer: PreTrainedTokenizerBase, pool: RewardPool | None = None):
        """`pool`: `reward.workers`' processes, where the rule function then runs (None: here)."""
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.separator_id = separator_id(tokenizer, cfg.separator)
        self.function: StepFunction | None = import_dotted(cfg.function, f"{KEY}.function") if cfg.function else None
        self.pool = pool if cfg.function is not None else None
        self.timeouts = 0
        """Calls of the rule function in `pool` that ran past reward.timeout_s."""
        self.prm = ProcessRewardEngine(cfg.model_path, tokenizer.pad_token_id) if cfg.model_path is not None else None

    def rewards(self, rollout: Rollout, references: list[str], policy: list[Tensor] | None = None) -> list[Tensor]:
        """Per sample (R_i,): weight * step score at each step's end token. `policy`: an env job's
        loss masks (R_i,), so that only policy tokens make steps and each turn ends one."""
        responses = rollout.responses
        masks = policy if policy is not None else [None] * len(responses)
        ends = [step_ends(r, self.separator_id, m) for r, m in zip(responses, masks)]
        if self.function is not None:
            scores = self._rule_scores(rollout, responses, ends, masks, references)
        else:
            scores = self._model_scores(rollout, ends)
        return [place_step_rewards(self.cfg.weight * s, e, len(r)) for s, e, r in zip(scores, ends, responses)]

    def _rule_scores(self, rollout: Rollout, responses: list[Tensor], ends: list[Tensor],
                     masks: list[Tensor | None], references: list[str]) -> list[Tensor]:
        decode = self.tokenizer.decode
        calls: list[Call] = []
        for sequence, prompt_len, response, own_ends, mask, reference in zip(
                rollout.sequences, rollout.prompt_lens.tolist(), responses, ends, masks, references):
            steps = [decode(response[a:b], skip_special_tokens=True)
                     for a, b in step_spans(response, own_ends, self.separator_id, mask)]
            calls.append((decode(sequence[:prompt_len], skip_special_tokens=True), steps, reference, {}))
        if self.pool is None:
            results: list = [[float(s) for s in self.function(*call[:3])] for call in calls]
        else:
            results, timeouts = self.pool.run(STEPS, calls)
            self.timeouts += log_timeouts(timeouts)
        out = []
        for (_, steps, _, _), scores in zip(calls, results):
            if len(scores) != len(steps):
                raise ValueError(f"{KEY}.function={self.cfg.function}: returned {len(scores)} scores for the "
                                 f"{len(steps)} steps {steps}")
            out.append(torch.tensor(scores, dtype=torch.float))
        return out

    def _model_scores(self, rollout: Rollout, ends: list[Tensor]) -> list[Tensor]:
        """The PRM's probability that each step is right, read at the step's end token."""
        return self.prm.step_scores(rollout.sequences, [p + e for p, e in zip(rollout.prompt_lens.tolist(), ends)])
