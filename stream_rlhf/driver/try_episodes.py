"""`stream-rlhf episodes CONFIG`: a few episodes of an env job, played with its policy and printed
turn by turn before any RL is run: what the policy writes, what the environment answers, each
turn's reward, why each episode ended (a failure with its message) and what its tool calls took.
For writing an environment (its tools, stop strings, limits) without starting the whole job.

    stream-rlhf episodes configs/text_tool_grpo.yaml --count 4            # the warm start's episodes
    stream-rlhf episodes CONFIG --checkpoint runs/x/checkpoint --greedy   # a trained policy's, greedy

The prompts are the first COUNT of the evaluation's (the task's eval split or `data.eval`), played
as evaluation plays them: the job's env config as it is (env.processes, limits, timeouts, stop
strings, observation cuts), by the torch sampler whatever `rollout.backend` (as evaluation), on the
job's device (`placement.device`), decoding as `rollout.decode` says, sampled at
rollout.temperature (or greedy) from seed `seed`. Texts keep their special tokens (`<eos>`, a
template's end of turn) so that where a turn stopped shows; an image's run of tokens shows as <image>.
An episode's return is the reward's score of its whole response plus its turn rewards. Exit status
1 when an episode failed.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any

from transformers import PreTrainedTokenizerBase

from stream_rlhf.config import ConfigError
from stream_rlhf.driver.evaluate import eval_items, eval_params, eval_policy, prompt_features
from stream_rlhf.driver.evaluate_episodes import play_episodes, returns_of
from stream_rlhf.envs.episode import Episode
from stream_rlhf.envs.episode_loop import EpisodeResult
from stream_rlhf.rl.config import RLJobConfig
from stream_rlhf.stages.job_context import JobContext
from stream_rlhf.stages.reward_forward import Scorer
from stream_rlhf.telemetry.episodes import FAILED
from stream_rlhf.telemetry.sample_log import IMAGE_SPAN

POLICY, OBSERVATION = "policy", "observation"


@dataclass(frozen=True)
class Segment:
    """One policy turn (with its reward) or one observation of an episode, as text."""

    kind: str
    text: str
    reward: float | None = None


def check_request(cfg: RLJobConfig, count: int) -> None:
    """ConfigError for a job without episodes or a count below 1 (before any warm start is made)."""
    if cfg.env is None:
        raise ConfigError("episodes: the job has no env section (its responses are single turns: see `run`)")
    if count < 1:
        raise ConfigError(f"--count {count}: must be >= 1")


def try_episodes(cfg: RLJobConfig, checkpoint: str, count: int,
                 greedy: bool) -> tuple[list[dict[str, Any]], float, str]:
    """The first `count` eval prompts played as episodes: one record each (see `record`), the
    seconds they took and how they were decoded (eager, static or graphs)."""
    check_request(cfg, count)
    tokenizer, model, static = eval_policy(cfg, checkpoint)
    items = eval_items(cfg, model, tokenizer)[0][:count]
    params = eval_params(cfg, tokenizer, checkpoint, 0.0 if greedy else cfg.rollout.temperature)
    starts = [item[4] for item in items]
    started = time.perf_counter()
    with Scorer(JobContext(cfg, checkpoint, "")) as scorer:
        result = play_episodes(cfg, model, tokenizer, starts, [item[0] for item in items],
                               prompt_features(model, items), params, (cfg.seed, "episodes"), static)
        returns = returns_of(result, starts, scorer).tolist()
    seconds = time.perf_counter() - started
    records = [record(result, i, tokenizer, starts[i].reference, returns[i]) for i in range(len(items))]
    return records, seconds, "eager" if static is None else static.mode


def record(result: EpisodeResult, i: int, tokenizer: PreTrainedTokenizerBase, reference: str,
           episode_return: float) -> dict[str, Any]:
    """Episode `i` of `result` as printed (and as `--json` writes it)."""
    episode = result.episodes[i]
    failure = next((f.split(": ", 1)[1] for f in result.failures if f.startswith(f"episode {i}: ")), None)
    return {"index": i, "reference": reference, "ended": result.ended[i], "failure": failure,
            "turns": episode.turns, "tool_calls": result.tool_calls[i], "tool_s": round(result.tool_s[i], 4),
            "return": round(episode_return, 4), "prompt": _text(tokenizer, episode.prompt_ids),
            "segments": [asdict(s) for s in segments(episode, tokenizer)]}


def segments(episode: Episode, tokenizer: PreTrainedTokenizerBase) -> list[Segment]:
    """The episode's policy turns and observations in order (a turn ends at each of its turn_ends)."""
    out: list[Segment] = []
    start, turn = 0, 0
    ends = set(episode.turn_ends)
    for i in range(1, len(episode.token_ids) + 1):
        last = i == len(episode.token_ids)
        policy = bool(episode.loss_mask[start])
        if last or (i - 1) in ends or bool(episode.loss_mask[i]) != policy:
            text = _text(tokenizer, episode.token_ids[start:i])
            if policy:
                out.append(Segment(POLICY, text, episode.turn_rewards[turn]))
                turn += 1
            else:
                out.append(Segment(OBSERVATION, text))
            start = i
    return out


def _text(tokenizer: PreTrainedTokenizerBase, ids: list[int]) -> str:
    """`ids` as text with their special tokens, each image's token run as <image>."""
    return IMAGE_SPAN.sub("<image>", tokenizer.decode(ids))


def report(records: list[dict[str, Any]], seconds: float, decode: str) -> str:
    """The episodes turn by turn, then one line of totals."""
    lines = []
    for r in records:
        calls = f"{r['tool_calls']} environment step{'s' if r['tool_calls'] != 1 else ''} ({r['tool_s']:.3f} s)"
        lines.append(f"episode {r['index']} (reference {r['reference']!r}): {r['ended']} after {r['turns']} "
                     f"turn{'s' if r['turns'] != 1 else ''}, {calls}, return {r['return']:.3f}")
        lines.append(f"  {'prompt':<12} {r['prompt']!r}")
        for s in r["segments"]:
            reward = f"  (reward {s['reward']:g})" if s["reward"] else ""
            lines.append(f"  {s['kind']:<12} {s['text']!r}{reward}")
        if r["failure"] is not None:
            lines.append(f"  {'failure':<12} {r['failure']}")
    ended = ", ".join(f"{why} {n}" for why, n in sorted(Counter(r["ended"] for r in records).items()))
    mean = sum(r["return"] for r in records) / len(records)
    lines.append(f"{len(records)} episode{'s' if len(records) != 1 else ''} in {seconds:.1f} s ({decode} decode): "
                 f"{ended}; "
                 f"mean return {mean:.3f}; "
                 f"{sum(r['tool_calls'] for r in records)} environment steps")
    return "\n".join(lines)


def json_line(records: list[dict[str, Any]], seconds: float, decode: str) -> str:
    return json.dumps({"episodes": records, "seconds": round(seconds, 3), "decode": decode})


def failed(records: list[dict[str, Any]]) -> bool:
    return any(r["ended"].startswith(FAILED) for r in records)
