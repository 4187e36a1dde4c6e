"""Seeing multi-turn episodes (telemetry/episodes.py, issue 34): rollout handles' "episodes"
metadata become stage counts (summary.json's `episodes` block and `episodes_failed` by reason,
summed over instances), one trace track per episode with a slice per tool wait, and the
iteration's metrics; the sample log records each logged sample's turns from its loss mask. The
handles and metadata are made by hand, as the episode loop writes them."""

from __future__ import annotations

import json

import msgspec
import pytest
import torch

from stream_rlhf.broker.control.messages import Handle
from stream_rlhf.envs.episode import Episode
from stream_rlhf.envs.episode_loop import EpisodeResult
from stream_rlhf.experience import Experience
from stream_rlhf.models.tokenizer import build_tokenizer
from stream_rlhf.samples import Rollout, ragged
from stream_rlhf.stage import Batch
from stream_rlhf.telemetry import trace
from stream_rlhf.telemetry.episodes import (
    CLOSES_FAILED,
    EPISODES,
    PROCESSES_REPLACED,
    EpisodeStats,
    episode_metrics,
    episode_summary,
    record_episodes,
)
from stream_rlhf.telemetry.progress import describe
from stream_rlhf.telemetry.sample_log import LOSS_MASK, SAMPLES_FILE, SampleLog, SampleLogConfig, turn_spans
from stream_rlhf.telemetry.stage_counts import StageCounts, read_stage_counts
from stream_rlhf.telemetry.trace_merge import merge_trace
from tests.trace_rules import check_trace

TOKENIZER = build_tokenizer()
T0 = 1_800_000_000.0
"""A start time (seconds since the epoch) for the hand-made tool waits."""


@pytest.fixture(autouse=True)
def no_trace_left_running():
    yield
    trace.stop()


def _stats(turns: list[int], ended: list[str], hidden_s: float) -> EpisodeStats:
    """One tool call after every turn but the last, each 0.05 s, waits laid out one after another
    (so tool_wall_s = tool_s)."""
    calls = [t - 1 for t in turns]
    waits = [(key, T0 + 0.1 * n, 0.05) for n, key in enumerate(k for k, c in enumerate(calls) for _ in range(c))]
    return EpisodeStats(turns=turns, tool_calls=calls, tool_s=[0.05 * c for c in calls], ended=ended,
                        tool_waits=waits, tool_wall_s=0.05 * sum(calls), tool_hidden_s=hidden_s)


def _handle_batch(minibatch: int, stats: EpisodeStats | None) -> Batch:
    metadata = {} if stats is None else {EPISODES: stats.encode()}
    return Batch(Handle(f"h{minibatch}", "experience", 0, minibatch, 0, 3, metadata=metadata), {})


def test_stats_of_an_episode_loop_result():
    done, failed = Episode(prompt_ids=[1, 2]), Episode(prompt_ids=[3])
    done.add_policy_turn([40, 41], logps=[-0.1, -0.2], policy_version=0)
    done.add_observation([50])
    done.add_policy_turn([42], logps=[-0.3], policy_version=1)
    failed.add_policy_turn([43], logps=[-0.4], policy_version=0)
    result = EpisodeResult([done, failed], ["done", "failed:raised"], [1, 1], [0.05, 0.02],
                           tool_waits=[(0, T0, 0.05), (1, T0, 0.02)], tool_hidden_s=0.03, tool_wall_s=0.05,
                           observations_cut=[1, 0])
    stats = EpisodeStats.decode(EpisodeStats.of(result).encode())
    assert stats == EpisodeStats(turns=[2, 1], tool_calls=[1, 1], tool_s=[0.05, 0.02], ended=["done", "failed:raised"],
                                 tool_waits=[(0, T0, 0.05), (1, T0, 0.02)], tool_wall_s=0.05, tool_hidden_s=0.03,
                                 observations_cut=[1, 0])
    older = json.loads(stats.encode())  # a handle journaled before observations were cut
    del older["observations_cut"]
    assert EpisodeStats.decode(json.dumps(older)).observations_cut == []


def test_the_metadata_round_trips_and_a_single_turn_handle_adds_nothing(tmp_path):
    stats = _stats([3, 1, 2], ["done", "failed:raised", "max_turns"], 0.1)
    assert EpisodeStats.decode(stats.encode()) == stats
    counts = StageCounts(tmp_path, "rollout", "rollout-0")
    record_episodes(counts, {"finished": 3}, 0, 0)  # a single-turn job's handle
    assert counts.values == {} and read_stage_counts(tmp_path) == {}
    record_episodes(counts, {"finished": 3}, 0, 0, generated=3)
    assert counts.values == {"generated": 3}
    with pytest.raises(msgspec.ValidationError, match="tool_calls"):
        EpisodeStats.decode(json.dumps({"turns": [1]}))  # the episode loop's bug, named


def test_a_minibatchs_counts_go_to_disk_in_one_write(tmp_path):
    """Rollout's generated count and its episodes' counts in one `add`: a rollout killed between two
    writes could count the samples it generated and not their episodes (seen once in a whole job)."""
    adds = []

    class Recorded(StageCounts):
        def add(self, **counts):
            adds.append(sorted(counts))
            super().add(**counts)

    counts = Recorded(tmp_path, "rollout", "rollout-0")
    record_episodes(counts, {EPISODES: _stats([2, 1], ["done", "done"], 0.0).encode()}, 0, 0, generated=2)
    assert len(adds) == 1 and {"generated", "episodes", "turns"} <= set(adds[0])
    assert read_stage_counts(tmp_path)["rollout"]["generated"] == read_stage_counts(tmp_path)["rollout"]["episodes"]


def test_counts_from_two_instances_give_the_summary(tmp_path):
    first, second = StageCounts(tmp_path, "rollout", "rollout-0"), StageCounts(tmp_path, "rollout", "rollout-1")
    record_episodes(first, {EPISODES: _stats([3, 1, 2], ["done", "failed:raised", "max_turns"], 0.1).encode()}, 0, 0)
    record_episodes(first, {EPISODES: _stats([2, 2], ["done", "failed:timeout"], 0.0).encode()}, 0, 1)
    cut = msgspec.structs.replace(_stats([4], ["failed:raised"], 0.15), observations_cut=[2])
    record_episodes(second, {EPISODES: cut.encode()}, 0, 2)
    second.add(**{CLOSES_FAILED: 2, PROCESSES_REPLACED: 1})
    counts = read_stage_counts(tmp_path)["rollout"]
    assert counts["episodes"] == 6 and counts["turns"] == 14 and counts["tool_calls"] == 8
    summary = episode_summary(counts)
    assert summary["episodes_failed"] == {"raised": 2, "timeout": 1}
    episodes = summary["episodes"]
    assert episodes["count"] == 6 and episodes["turns_per_episode"] == round(14 / 6, 4)
    assert episodes["ended"] == {"done": 2, "max_turns": 1}
    assert episodes["closes_failed"] == 2 and episodes["processes_replaced"] == 1
    assert episodes["observations_cut"] == 2
    assert episodes["tool_s"] == episodes["tool_wall_s"] == pytest.approx(0.4)
    assert episodes["tool_hidden_s"] == pytest.approx(0.25)
    assert episodes["tool_hidden_frac"] == pytest.approx(0.625)
    assert "prefix_cache" not in episodes  # the torch sampler's turns send no context again
    first.add(turn_context_tokens=300, turn_cached_tokens=96)  # a vLLM sampler's, at its close
    second.add(turn_context_tokens=100, turn_cached_tokens=32)
    prefix_cache = episode_summary(read_stage_counts(tmp_path)["rollout"])["episodes"]["prefix_cache"]
    assert prefix_cache == {"context_tokens": 400, "cached_tokens": 128, "hit_frac": 0.32}


def test_a_run_without_episodes_summarises_to_zeros():
    summary = episode_summary({"generated": 64})
    assert summary["episodes_failed"] == {} and summary["episodes"]["count"] == 0
    assert summary["episodes"]["tool_hidden_frac"] == 0.0


def test_tool_waits_are_slices_on_a_track_per_episode(tmp_path):
    trace.start(tmp_path / "events", process="rollout-0", thread="rank 0")
    stats = _stats([3, 1, 12], ["done", "done", "max_turns"], 0.0)
    record_episodes(StageCounts(tmp_path, "rollout", "rollout-0", write=False), {EPISODES: stats.encode()}, 4, 1)
    trace.stop()
    merged = merge_trace(tmp_path / "events", tmp_path / "trace.json", {}, ["rollout"])
    assert check_trace(json.loads((tmp_path / "trace.json").read_text())) == []
    tracks = {e["tid"]: e["args"]["name"] for e in merged.events if e["name"] == "thread_name"}
    waits = [e for e in merged.events if e["ph"] == "X" and e["cat"] == "tool"]
    assert len(waits) == sum(stats.tool_calls) == 13
    by_track: dict[str, list[dict]] = {}
    for event in waits:
        by_track.setdefault(tracks[event["tid"]], []).append(event)
    assert sorted(by_track) == ["rank 0/episode 000", "rank 0/episode 002"]  # episode 1 made no call
    assert {e["name"] for e in by_track["rank 0/episode 002"]} == {"tool wait ep 2"}
    first = min(by_track["rank 0/episode 000"], key=lambda e: e["ts"])
    assert first["ts"] == round(T0 * 1e6) and first["dur"] == 50_000
    assert first["args"] == {"iteration": 4, "minibatch": 1, "episode": 0}
    assert tracks[0] == "rank 0" and sorted(tracks)[1:] == [1000, 1001]  # the rank's own track comes first


def test_iteration_metrics_from_the_minibatches_metadata():
    cut = msgspec.structs.replace(_stats([2, 2, 2], ["done", "done", "failed:timeout"], 0.05),
                                  observations_cut=[0, 3, 1])
    batches = [_handle_batch(0, _stats([3, 1, 2], ["done", "failed:raised", "done"], 0.1)), _handle_batch(1, cut)]
    batches[1].tensors["trained"] = torch.tensor([True, True, False])  # env.failed_episodes=mask
    record = episode_metrics(batches)
    assert record == {"turns_per_episode": 2.0, "tool_calls": 6, "tool_s": pytest.approx(0.3),
                      "tool_hidden_frac": pytest.approx(0.5), "episodes_failed": 2, "observations_cut": 4,
                      "episodes_masked": 1}
    assert episode_metrics([_handle_batch(0, None)]) == {}
    # calls of several episodes overlap: the fraction is of the wall-clock seconds, not of tool_s
    overlapping = msgspec.structs.replace(_stats([3, 3], ["done", "done"], 0.04), tool_wall_s=0.05)
    record = episode_metrics([_handle_batch(0, overlapping)])
    assert record["tool_s"] == pytest.approx(0.2) and record["tool_hidden_frac"] == pytest.approx(0.8)


@pytest.mark.parametrize(("mask", "spans"), [
    ([1, 1, 0, 1], [(0, 2, "policy"), (2, 3, "observation"), (3, 4, "policy")]),
    ([1, 1, 1], [(0, 3, "policy")]),
    ([1, 0, 0], [(0, 1, "policy"), (1, 3, "observation")]),
    ([], []),
])
def test_turn_spans(mask, spans):
    assert turn_spans([bool(m) for m in mask]) == spans


def _episode_batch(masks: list[list[int]] | None) -> Batch:
    """Three samples: prompt "n=?" + a response of len(mask) tokens."""
    lengths = [len(m) for m in masks] if masks else [2, 2, 2]
    prompts = [TOKENIZER.encode(f"{n}=?", add_special_tokens=False) for n in range(3)]
    responses = [[TOKENIZER.encode("7", add_special_tokens=False)[0]] * n for n in lengths]
    rollout = Rollout(sequences=[torch.tensor(p + r) for p, r in zip(prompts, responses)],
                      prompt_lens=torch.tensor([len(p) for p in prompts], dtype=torch.int32),
                      behavior_logp=[torch.full((n,), -0.5) for n in lengths], group_ids=torch.arange(3))
    tensors = {**rollout.to_tensors(), "scores": torch.ones(3)}
    if masks:
        tensors.update(ragged(LOSS_MASK, [torch.tensor(m, dtype=torch.bool) for m in masks]))
    return Batch(Handle("h", "experience", 0, 0, 0, 3), tensors)


def _log(tmp_path, batch: Batch) -> list[dict]:
    exp = Experience.from_batches([batch])
    log = SampleLog(tmp_path, SampleLogConfig(per_minibatch=3), TOKENIZER)
    log.write([batch], exp, torch.zeros(exp.mask.shape), exp.kl("k1"), 0)
    return [json.loads(line) for line in (tmp_path / SAMPLES_FILE).read_text().splitlines()]


def test_the_sample_log_records_turn_spans_from_the_loss_mask(tmp_path):
    masks = [[1, 1, 0, 0, 1], [1, 1, 1], [1, 0, 1, 0, 1, 1]]
    lines = _log(tmp_path, _episode_batch(masks))
    assert [line["turns"] for line in lines] == [
        [[0, 2, "policy"], [2, 4, "observation"], [4, 5, "policy"]],
        [[0, 3, "policy"]],
        [[0, 1, "policy"], [1, 2, "observation"], [2, 3, "policy"], [3, 4, "observation"], [4, 6, "policy"]],
    ]
    assert [len(line["tokens"]) for line in lines] == [5, 3, 6]


def test_the_sample_log_marks_a_failed_episode_that_is_not_trained(tmp_path):
    batch = _episode_batch([[1, 1, 0, 0, 1], [1, 1, 1], [1, 0, 1, 0, 1, 1]])
    batch.tensors["trained"] = torch.tensor([True, False, True])  # env.failed_episodes: mask
    assert [line["trained"] for line in _log(tmp_path, batch)] == [True, False, True]


def test_a_single_turn_sample_has_no_turns(tmp_path):
    assert [line["turns"] for line in _log(tmp_path, _episode_batch(None))] == [None, None, None]


def test_the_progress_line_shows_turns_only_for_episodes():
    single = {"iteration": 0, "reward": 0.5, "kl": 0.01, "tokens_per_s": 100.0}
    assert "turns" not in describe(single)
    line = describe(single | {"turns_per_episode": 2.5, "tool_hidden_frac": 0.42})
    assert line.endswith("2.50 turns/ep  tool hidden 42%")
