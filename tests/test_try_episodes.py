"""`stream-rlhf episodes CONFIG` (`driver/try_episodes.py`): an env job's first eval episodes played
with a checkpoint and printed turn by turn, through the real CLI, episode loop, environment and
scorer, on the job's device and decoder; exit 1 when an episode failed, 2 for a job it cannot play."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from stream_rlhf import cli
from stream_rlhf.models.checkpoint import build_tiny, save_checkpoint
from stream_rlhf.models.model_config import TinyModelConfig
from stream_rlhf.models.tokenizer import build_tokenizer
from tests.rl_tiny import tiny_job, write_job

SCRIPTED = {"factory": "tests.test_episode_loop:scripted", "max_turns": 3, "max_episode_tokens": 32}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("policy")
    tokenizer = build_tokenizer()
    save_checkpoint(build_tiny(TinyModelConfig(num_hidden_layers=1), tokenizer, seed=0), tokenizer, folder)
    return str(folder)


def _config(tmp_path: Path, env: dict | None) -> str:
    """The tiny job with `env`, scored by its turn rewards alone (without one: the arithmetic reward)."""
    reward = {"reward.function": None} if env is not None else {}
    return str(write_job(tmp_path / "job.yaml", tiny_job(tmp_path, "episodes", env=env, **reward)))


def _episodes(capsys, *argv: str) -> tuple[int, str, dict]:
    code = cli.main(["episodes", *argv, "--json"])
    out = capsys.readouterr().out
    return code, out, json.loads(out.strip().splitlines()[-1])


def test_each_episode_is_printed_turn_by_turn(tmp_path, checkpoint, capsys):
    env = {**SCRIPTED, "options": {"turns": 2, "observation": "=12"}}
    code, out, printed = _episodes(capsys, _config(tmp_path, env=env), "--checkpoint", checkpoint, "--count", "3")
    assert code == 0
    episodes = printed["episodes"]
    assert [e["index"] for e in episodes] == [0, 1, 2] and all(e["ended"] == "done" for e in episodes)
    for e in episodes:  # policy turn, the tool's "=12", policy turn; each turn's reward 0.25: the return 0.5
        assert [s["kind"] for s in e["segments"]] == ["policy", "observation", "policy"]
        assert e["segments"][1]["text"] == "=12" and [s["reward"] for s in e["segments"]] == [0.25, None, 0.25]
        assert e["return"] == 0.5 and e["tool_calls"] == 2 and e["failure"] is None
        assert e["prompt"].startswith("<bos>") and e["prompt"].endswith("=")
    assert f"episode 0 (reference {episodes[0]['reference']!r}): done after 2 turns, 2 environment steps" in out
    assert "  observation  '=12'" in out
    assert "3 episodes in " in out and "(eager decode): done 3; mean return 0.500; 6 environment steps" in out


def test_a_failed_episode_shows_its_message_and_exits_1(tmp_path, checkpoint, capsys):
    env = {**SCRIPTED, "options": {"turns": 3, "fail": "raise", "fail_turn": 2}}
    code, out, printed = _episodes(capsys, _config(tmp_path, env=env), "--checkpoint", checkpoint, "--count", "2",
                                   "--greedy")
    assert code == 1
    assert [e["ended"] for e in printed["episodes"]] == ["failed:raised"] * 2
    assert printed["episodes"][0]["failure"] == "Scripted.step raised ValueError: tool crashed"
    assert "  failure      Scripted.step raised ValueError: tool crashed" in out


def test_the_episodes_decode_as_rollout_decode_says_with_the_eager_tokens(tmp_path, checkpoint, capsys):
    env = {**SCRIPTED, "options": {"turns": 2, "observation": "=12"}}  # env.schedule stream: played lockstep
    config = _config(tmp_path, env=env)
    played = {}
    for mode in ("eager", "static"):
        _, out, printed = _episodes(capsys, config, "--checkpoint", checkpoint, "--count", "3", "--set",
                                    f"rollout.decode={mode}")
        assert printed["decode"] == mode and f"({mode} decode)" in out
        played[mode] = [{k: v for k, v in e.items() if k != "tool_s"} for e in printed["episodes"]]  # seconds differ
    assert played["static"] == played["eager"] and all(e["segments"] for e in played["eager"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="plays the episodes on a CUDA device")
def test_a_cuda_job_plays_its_episodes_on_the_gpu_as_on_the_cpu(tmp_path, checkpoint, capsys):
    env = {**SCRIPTED, "options": {"turns": 2, "observation": "=12"}}
    config = _config(tmp_path, env=env)
    played = {device: _episodes(capsys, config, "--checkpoint", checkpoint, "--count", "3", "--greedy", "--set",
                                f"placement.device={device}")[2]["episodes"] for device in ("cpu", "cuda")}
    assert [[s["kind"] for s in e["segments"]] for e in played["cuda"]] == \
        [[s["kind"] for s in e["segments"]] for e in played["cpu"]]
    assert [e["return"] for e in played["cuda"]] == [e["return"] for e in played["cpu"]]


@pytest.mark.parametrize(("env", "argv", "words"), [
    (None, (), "episodes: the job has no env section"),
    (SCRIPTED, ("--count", "0"), "--count 0: must be >= 1"),
    (SCRIPTED, ("--checkpoint", "/nonexistent"), "--checkpoint /nonexistent: no config.json there"),
])
def test_what_it_cannot_play_exits_2_naming_it_before_any_warm_start(tmp_path, capsys, monkeypatch, env, argv, words):
    def no_warm_start(cfg):
        raise AssertionError("a warm start was made for a request that fails")

    monkeypatch.setattr("stream_rlhf.driver.warm_start.warm_start", no_warm_start)
    assert cli.main(["episodes", _config(tmp_path, env=env), *argv]) == 2
    assert words in capsys.readouterr().err
