"""What the episodes of a multi-turn job (`env:` in the config, `envs/`) did, seen in the run's
counts, trace and metrics: turns, tool calls, tool time and how much of it the pipeline hid,
and why episodes ended.

    metadata[EPISODES] = EpisodeStats.of(result).encode()     # rollout: an EpisodeResult (envs/episode_loop.py)
    record_episodes(counts, metadata, iteration, minibatch, generated=n)   # rollout, after each mini-batch
    record.update(episode_metrics(batches))                    # actor_train: metrics.jsonl, per iteration
    summary.update(episode_summary(counts["rollout"]))         # the driver: summary.json

A rollout handle of an env job carries one `EpisodeStats` as JSON in its metadata "episodes";
its lists have one entry per sample (an episode) of the mini-batch. The counts go to the stage's
`StageCounts` (summed over instances and restarts into summary.json), each tool call becomes a
slice "tool wait ep <key>" (resets too) on a track of its own per episode key under the rollout instance
("rank 0/episode 003") in the trace, and every trained iteration's metrics line gets the
figures of its mini-batches. A handle without "episodes" (a single-turn job) adds nothing.

Words: a *tool call* is one environment step after a policy turn; *tool_s* the seconds each
episode spent in environment calls, summed over episodes (calls of several episodes overlap);
*tool_wall_s* the wall-clock seconds during which some environment call was running, and
*tool_hidden_s* the part of those during which the sampler had turns to decode (the wait was
hidden); `tool_hidden_frac` = tool_hidden_s / tool_wall_s (1: rollout never waited for a tool).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import msgspec

from stream_rlhf.telemetry import trace

if TYPE_CHECKING:
    from stream_rlhf.envs.episode_loop import EpisodeResult
    from stream_rlhf.stage import Batch
    from stream_rlhf.telemetry.stage_counts import StageCounts

EPISODES = "episodes"
"""The handle metadata key (a JSON string of `EpisodeStats`)."""
FAILED = "failed:"
"""How `ended` names a failed episode: "failed:<reason>" (raised, timeout, malformed, ...)."""
ENDED_COUNT = "episodes_ended."
FAILED_COUNT = "episodes_failed."
"""Prefixes of the per-reason stage counts: `episodes_ended.done`, `episodes_failed.raised`."""
CLOSES_FAILED = "env_closes_failed"
"""The stage count of environment `close()` calls that raised or timed out (rollout adds it as
they are reported: a close runs after its episode's handle may have gone)."""
PROCESSES_REPLACED = "env_processes_replaced"
"""The stage count of environment processes (`env.processes`) started to replace one that died or
had a call past its timeout."""
DIGITS = 4


class EpisodeStats(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One mini-batch's episodes; every list but `tool_waits` has one entry per sample."""

    turns: list[int]
    """Policy turns of each episode."""
    tool_calls: list[int]
    """Environment steps of each episode."""
    tool_s: list[float]
    """Seconds each episode's environment calls took (resets and steps)."""
    ended: list[str]
    """Why each ended: "done" | "max_turns" | "max_episode_tokens" | "failed:<reason>"."""
    tool_waits: list[tuple[int, float, float]]
    """Every environment call: (episode key, start in seconds since the epoch, seconds)."""
    tool_wall_s: float
    """Wall-clock seconds during which an environment call was running."""
    tool_hidden_s: float
    """The part of tool_wall_s during which the sampler had turns to decode."""
    observations_cut: list[int] = []
    """Observations of each episode cut to env.max_observation_tokens (empty in a handle written
    before there was a limit)."""

    @staticmethod
    def of(result: EpisodeResult) -> EpisodeStats:
        return EpisodeStats(turns=[e.turns for e in result.episodes], tool_calls=list(result.tool_calls),
                            tool_s=list(result.tool_s), ended=list(result.ended),
                            tool_waits=[(k, start, s) for k, start, s in result.tool_waits],
                            tool_wall_s=result.tool_wall_s, tool_hidden_s=result.tool_hidden_s,
                            observations_cut=list(result.observations_cut))

    def encode(self) -> str:
        return msgspec.json.encode(self).decode()

    @staticmethod
    def decode(text: str) -> EpisodeStats:
        return msgspec.json.decode(text, type=EpisodeStats)


def episode_stats(metadata: Mapping[str, object]) -> EpisodeStats | None:
    """The stats a handle's metadata carries; None for a single-turn handle."""
    text = metadata.get(EPISODES)
    if text is None:
        return None
    if not isinstance(text, str):
        raise TypeError(f"handle metadata {EPISODES!r} must be a JSON string, got {type(text).__name__}")
    return EpisodeStats.decode(text)


def record_episodes(counts: StageCounts, metadata: Mapping[str, object], iteration: int, minibatch: int,
                    **also: float) -> None:
    """Rollout's call after generating mini-batch (iteration, minibatch): its episodes' counts and
    tool-wait slices, added with `also` (the mini-batch's own counts) in one write, so that a
    rollout killed in between cannot keep some and lose the others. Only `also` for a handle
    without episodes."""
    stats = episode_stats(metadata)
    if stats is None:
        if also:
            counts.add(**also)
        return
    count_episodes(counts, stats, **also)
    trace_tool_waits(stats, iteration, minibatch)


def count_episodes(counts: StageCounts, stats: EpisodeStats, **also: float) -> None:
    """Adds episodes, turns, tool_calls, tool_s, tool_wall_s, tool_hidden_s, observations_cut and
    one count per end reason (and `also`), in one `add`."""
    ends: dict[str, int] = {}
    for ended in stats.ended:
        key = FAILED_COUNT + ended[len(FAILED):] if ended.startswith(FAILED) else ENDED_COUNT + ended
        ends[key] = ends.get(key, 0) + 1
    counts.add(episodes=len(stats.turns), turns=sum(stats.turns), tool_calls=sum(stats.tool_calls),
               tool_s=sum(stats.tool_s), tool_wall_s=stats.tool_wall_s, tool_hidden_s=stats.tool_hidden_s,
               observations_cut=sum(stats.observations_cut), **ends, **also)


def episode_track(key: int) -> str:
    """The trace track of episode `key`'s tool waits (zero-padded: the tracks sort by key)."""
    return f"episode {key:03d}"


def trace_tool_waits(stats: EpisodeStats, iteration: int, minibatch: int) -> None:
    """One "tool wait ep <key>" slice per tool call, on its episode's track."""
    for key, start_s, seconds in stats.tool_waits:
        start_ns = round(start_s * 1e9)
        trace.complete_on(episode_track(key), f"tool wait ep {key}", "tool", start_ns, start_ns + round(seconds * 1e9),
                          iteration=iteration, minibatch=minibatch, episode=key)


def episode_metrics(batches: list[Batch]) -> dict[str, float]:
    """An iteration's figures from its mini-batches (their handles carry rollout's metadata;
    `episodes_masked`: failed episodes trained without loss, env.failed_episodes=mask, from their
    `trained` field); {} when none has episodes."""
    stats = [s for b in batches if (s := episode_stats(b.metadata)) is not None]
    if not stats:
        return {}
    episodes = sum(len(s.turns) for s in stats)
    wall_s = sum(s.tool_wall_s for s in stats)
    return {
        "turns_per_episode": round(sum(sum(s.turns) for s in stats) / max(episodes, 1), DIGITS),
        "tool_calls": sum(sum(s.tool_calls) for s in stats),
        "tool_s": round(sum(sum(s.tool_s) for s in stats), DIGITS),
        "tool_hidden_frac": round(sum(s.tool_hidden_s for s in stats) / wall_s, DIGITS) if wall_s > 0 else 0.0,
        "episodes_failed": sum(e.startswith(FAILED) for s in stats for e in s.ended),
        "observations_cut": sum(sum(s.observations_cut) for s in stats),
        "episodes_masked": sum(int((~b.tensors["trained"]).sum()) for b in batches if "trained" in b.tensors),
    }


def episode_summary(rollout_counts: Mapping[str, float]) -> dict[str, object]:
    """summary.json's `episodes` block (with `closes_failed`: environment closes that raised or
    timed out, `processes_replaced`: environment processes started in place of others, and
    `observations_cut`: observations cut to env.max_observation_tokens) and
    `episodes_failed` (reason -> episodes) from rollout's summed stage counts; on vLLM the block
    adds `prefix_cache`: the context tokens its turns sent, those the prefix cache held, and their
    ratio."""
    episodes = int(rollout_counts.get("episodes", 0))
    wall_s = float(rollout_counts.get("tool_wall_s", 0.0))
    hidden_s = float(rollout_counts.get("tool_hidden_s", 0.0))

    def by_reason(prefix: str) -> dict[str, int]:
        return {k[len(prefix):]: int(v) for k, v in sorted(rollout_counts.items()) if k.startswith(prefix)}

    context = int(rollout_counts.get("turn_context_tokens", 0))
    cached = int(rollout_counts.get("turn_cached_tokens", 0))
    prefix_cache = {"context_tokens": context, "cached_tokens": cached,
                    "hit_frac": round(cached / context, DIGITS) if context else 0.0}
    return {
        "episodes": {
            "count": episodes,
            "turns_per_episode": round(rollout_counts.get("turns", 0) / max(episodes, 1), DIGITS),
            "tool_calls": int(rollout_counts.get("tool_calls", 0)),
            "tool_s": round(float(rollout_counts.get("tool_s", 0.0)), 3),
            "tool_wall_s": round(wall_s, 3),
            "tool_hidden_s": round(hidden_s, 3),
            "tool_hidden_frac": round(hidden_s / wall_s, DIGITS) if wall_s > 0 else 0.0,
            "ended": by_reason(ENDED_COUNT),
            "closes_failed": int(rollout_counts.get(CLOSES_FAILED, 0)),
            "processes_replaced": int(rollout_counts.get(PROCESSES_REPLACED, 0)),
            "observations_cut": int(rollout_counts.get("observations_cut", 0)),
            **({"prefix_cache": prefix_cache} if "turn_context_tokens" in rollout_counts else {}),
        },
        "episodes_failed": by_reason(FAILED_COUNT),
    }
