"""`stream-rlhf run --resume`: a run stopped mid-way (SIGTERM) continues from its last checkpoint.

Under `schedule: sync` a run is deterministic for its seed, so the resumed run must end with the
very weights of an uninterrupted one; under `stream` with overlap the accounting must hold across
the stop (every iteration trained once, the staleness bound kept).
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from stream_rlhf.models.medusa import has_heads
from stream_rlhf.resume.background_writer import WRITE_DELAY_VARIABLE
from stream_rlhf.telemetry.metrics import read_metrics
from tests.rl_tiny import tiny_job, write_job

pytestmark = pytest.mark.slow


def _start(config: Path, log: Path, *extra: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    with log.open("a") as out:
        return subprocess.Popen([sys.executable, "-m", "stream_rlhf.cli", "run", str(config), *extra],
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, **(env or {})})


def _stop_after(process: subprocess.Popen, metrics: Path, iterations: int, log: Path) -> None:
    """SIGTERM once `iterations` iterations are in `metrics`, then wait for the drained exit."""
    deadline = time.monotonic() + 240
    while len(read_metrics(metrics)) < iterations:
        assert process.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.2)
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=120) == 130, log.read_text()[-3000:]


def _config(tmp_path: Path, name: str, **overrides) -> Path:
    data = tiny_job(tmp_path, name, broker={"shm_prefix": f"r_{name}"}, **overrides)
    return write_job(tmp_path / f"{name}.yaml", data)


@pytest.mark.parametrize("lora", [False, True])
def test_a_sync_run_stopped_and_resumed_ends_with_the_weights_of_an_uninterrupted_one(tmp_path, lora):
    """With actor.lora too: the checkpoint keeps the adapters apart, the resumed weight store gets
    them merged, and the adapters train on from where they were."""
    shape = {"iterations": 6, "schedule": "sync", "overlap_depth": 0,
             "checkpoint": {"every": 2, "keep": 2, "background": False},
             "algorithm.advantage": "grpo", "rollout_batch.samples_per_prompt": 2,
             **({"actor": {"lr": 0.01, "lora": {"rank": 4}}} if lora else {})}
    whole = _config(tmp_path, "whole", **shape)
    log = tmp_path / "whole.log"
    assert _start(whole, log).wait(timeout=300) == 0, log.read_text()[-3000:]

    cut = _config(tmp_path, "cut", **shape)
    log = tmp_path / "cut.log"
    # the tiny job trains its 6 iterations in ~1.5 s: slowed, the stop lands before the end
    _stop_after(_start(cut, log, env={WRITE_DELAY_VARIABLE: "0.5"}), tmp_path / "cut" / "metrics.jsonl", 3, log)
    stopped_at = [int(p.name[5:]) for p in (tmp_path / "cut" / "checkpoints").glob("iter-*")]
    assert max(stopped_at) >= 3  # saved at the stop, not only every 2 iterations
    assert f"continue with `stream-rlhf run {cut} --resume" in log.read_text()
    assert _start(cut, log, "--resume").wait(timeout=300) == 0, log.read_text()[-3000:]

    expected = load_file(tmp_path / "whole" / "checkpoint" / "model.safetensors")
    resumed = load_file(tmp_path / "cut" / "checkpoint" / "model.safetensors")
    start = load_file(Path(json.loads((tmp_path / "whole" / "summary.json").read_text())["start_checkpoint"])
                      / "model.safetensors")
    assert max((expected[k] - start[k]).abs().max().item() for k in expected) > 1e-4  # RL moved the weights
    for name, tensor in expected.items():
        assert (resumed[name] - tensor).abs().max().item() <= 1e-6, name
    summary = json.loads((tmp_path / "cut" / "summary.json").read_text())
    assert summary["resumed_from"] == [max(stopped_at)]
    assert [r["iteration"] for r in read_metrics(tmp_path / "cut" / "metrics.jsonl")] == list(range(6))
    # every sample generated once (what the stopped run generated after its checkpoint was kept
    # and trained as it was) and trained once
    assert summary["samples_trained"] == summary["samples_generated"] == 6 * 2 * 16
    assert summary["samples_discarded_at_resume"] == 0


def test_a_sync_ppo_run_with_a_critic_warm_up_stopped_inside_it_and_after_it_ends_as_an_uninterrupted_one(tmp_path):
    """The warm-up's iterations train no actor, so a checkpoint's iteration count and its policy
    version differ: the resumed legs must start the actor at the policy version (0 inside the
    warm-up) and the critic at the iteration, and still give the weights of an uninterrupted run."""
    warmup, iterations = 3, 7
    shape = {"iterations": iterations, "schedule": "sync", "overlap_depth": 0, "critic.warmup_iterations": warmup,
             "checkpoint": {"every": 1, "keep": 2, "background": False}}
    whole = _config(tmp_path, "whole", **shape)
    log = tmp_path / "whole.log"
    assert _start(whole, log).wait(timeout=300) == 0, log.read_text()[-3000:]

    cut = _config(tmp_path, "cut", **shape)
    log = tmp_path / "cut.log"
    metrics = tmp_path / "cut" / "metrics.jsonl"
    slow = {WRITE_DELAY_VARIABLE: "0.5"}  # iterations wait for each checkpoint: a stop lands where it is asked
    _stop_after(_start(cut, log, env=slow), metrics, 1, log)
    _stop_after(_start(cut, log, "--resume", env=slow), metrics, warmup + 2, log)
    assert _start(cut, log, "--resume").wait(timeout=300) == 0, log.read_text()[-3000:]

    summary = json.loads((tmp_path / "cut" / "summary.json").read_text())
    inside, after = summary["resumed_from"]
    assert 1 <= inside <= warmup < after < iterations, summary["resumed_from"]
    resumed = [int(v) for v in re.findall(r"actor_train-0 .*resumed from \S+ at policy version (\d+)", log.read_text())]
    assert resumed == [0, after - warmup]
    expected = load_file(tmp_path / "whole" / "checkpoint" / "model.safetensors")
    got = load_file(tmp_path / "cut" / "checkpoint" / "model.safetensors")
    for name, tensor in expected.items():
        assert (got[name] - tensor).abs().max().item() <= 1e-6, name
    records = read_metrics(metrics)
    assert [r["iteration"] for r in records] == list(range(iterations))
    assert [r["policy_version"] for r in records] == [0] * warmup + list(range(1, iterations - warmup + 1))
    assert [r["reward"] for r in records] == [r["reward"] for r in read_metrics(tmp_path / "whole" / "metrics.jsonl")]
    critic = read_metrics(tmp_path / "cut" / "critic_metrics.jsonl")
    assert [r.get("critic_warmup", 0) for r in critic] == [1] * warmup + [0] * (iterations - warmup)
    assert summary["samples_trained"] == summary["samples_generated"] == iterations * 2 * 8
    assert summary["samples_critic_warmup"] == warmup * 2 * 8 and summary["samples_discarded_at_resume"] == 0


def test_a_streaming_ppo_run_resumes_with_its_accounting_and_staleness_bound_intact(tmp_path):
    """PPO (a critic too), overlap_depth 1, weights broadcast to rollout over a gloo group."""
    config = _config(tmp_path, "stream", iterations=6, overlap_depth=1, checkpoint={"every": 1, "keep": 1},
                     weights={"transport": "broadcast"})  # rollout joins its group and gets the resumed version
    log = tmp_path / "stream.log"
    _stop_after(_start(config, log), tmp_path / "stream" / "metrics.jsonl", 2, log)
    assert _start(config, log, "--resume", str(tmp_path / "stream")).wait(timeout=300) == 0, log.read_text()[-3000:]
    summary = json.loads((tmp_path / "stream" / "summary.json").read_text())
    [resumed_at] = summary["resumed_from"]
    assert resumed_at >= 2
    records = read_metrics(tmp_path / "stream" / "metrics.jsonl")
    assert [r["iteration"] for r in records] == list(range(6))  # none lost, none repeated
    assert all(r["staleness_max"] <= 1 for r in records)
    assert summary["samples_trained"] == summary["samples_generated"] == 6 * 2 * 8  # each once
    assert summary["samples_dropped"] == summary["samples_discarded_at_resume"] == 0
    assert not list((tmp_path / "stream" / "checkpoints" / "generated").glob("00000[0-4]-*"))  # pruned once trained
    critic = read_metrics(tmp_path / "stream" / "critic_metrics.jsonl")
    assert [r["iteration"] for r in critic] == list(range(6))
    assert len(list((tmp_path / "stream" / "checkpoints").glob("iter-*"))) == 1  # keep: 1


def test_a_run_with_companion_medusa_heads_resumes_them(tmp_path):
    config = _config(tmp_path, "medusa", iterations=5, checkpoint={"every": 1, "keep": 5},
                     **{"rollout.medusa.enabled": True})
    log = tmp_path / "medusa.log"
    metrics = tmp_path / "medusa" / "metrics.jsonl"
    process = _start(config, log)
    deadline = time.monotonic() + 240
    while not list((tmp_path / "medusa" / "checkpoints").glob("iter-*/medusa/MANIFEST.json")) or \
            len(read_metrics(metrics)) < 2:
        assert process.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.2)
    _stop_after(process, metrics, 2, log)
    assert _start(config, log, "--resume").wait(timeout=300) == 0, log.read_text()[-3000:]
    assert "medusa_train-0 INFO resumed the Medusa heads of" in log.read_text()
    summary = json.loads((tmp_path / "medusa" / "summary.json").read_text())
    assert summary["samples_trained"] == summary["samples_generated"] == 5 * 2 * 8
    assert has_heads(tmp_path / "medusa" / "checkpoint")  # the final heads, beside the policy


def test_resume_refuses_a_changed_model_naming_the_key_and_takes_a_changed_learning_rate(tmp_path):
    config = _config(tmp_path, "changed", iterations=2, checkpoint={"every": 1})
    log = tmp_path / "changed.log"
    assert _start(config, log).wait(timeout=300) == 0, log.read_text()[-3000:]
    process = _start(config, log, "--resume", "--set", "model.tiny.intermediate_size=96", "--set", "iterations=3")
    assert process.wait(timeout=120) == 2
    assert "model.tiny.intermediate_size=96: the run to resume had 128" in log.read_text()
    # a learning rate and the iteration count may change: the finished run trains one more iteration
    process = _start(config, log, "--resume", "--set", "actor.lr=5.0e-5", "--set", "iterations=3")
    assert process.wait(timeout=300) == 0, log.read_text()[-3000:]
    assert [r["iteration"] for r in read_metrics(tmp_path / "changed" / "metrics.jsonl")] == [0, 1, 2]
    summary = json.loads((tmp_path / "changed" / "summary.json").read_text())
    assert summary["resumed_from"] == [2]
    # stopped during its eval after RL (no summary.json yet): --resume trains nothing, deletes
    # nothing, and writes what was left
    (tmp_path / "changed" / "summary.json").unlink()
    process = _start(config, log, "--resume", "--set", "iterations=3")
    assert process.wait(timeout=300) == 0, log.read_text()[-3000:]
    assert "--resume: the training had ended (all 3 iterations" in log.read_text()
    again = json.loads((tmp_path / "changed" / "summary.json").read_text())
    for key in ("iterations", "samples_generated", "samples_trained", "resumed_from", "eval_reward_before",
                "eval_reward_after", "start_checkpoint"):
        assert again[key] == summary[key], key
    assert [r["iteration"] for r in read_metrics(tmp_path / "changed" / "metrics.jsonl")] == [0, 1, 2]


def _live_pids(log: Path) -> dict[str, int]:
    """The newest process of every stage instance that is still running, from the broker's log."""
    pids = {m[0]: int(m[1]) for m in re.findall(r"instance (\S+) of stage \S+ joined \(pid (\d+)\)", log.read_text())}
    return {name: pid for name, pid in pids.items() if _alive(pid)}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


@pytest.mark.timeout(900)  # each resume starts every stage process again: about a minute on a loaded 2-core machine
def test_a_run_whose_stages_are_killed_again_and_again_finishes_with_every_sample_accounted(tmp_path):
    """kill -9 of a restartable stage (restarted by the launcher), of a trainer and of a random
    stage (the run resumes itself from its newest checkpoint), at moments of a seeded choice."""
    iterations, per_iteration = 10, 2 * 8
    config = _config(tmp_path, "chaos", iterations=iterations, overlap_depth=1,
                     checkpoint={"every": 1, "keep": 2, "recoveries": 3})
    log = tmp_path / "chaos.log"
    process = _start(config, log)
    metrics = tmp_path / "chaos" / "metrics.jsonl"
    rng = random.Random(7)
    victims = []
    for kill, pick in enumerate(("ref_forward", "actor_train", None)):
        deadline = time.monotonic() + 240
        while len(read_metrics(metrics)) < 2 + 2 * kill or not _live_pids(log):
            assert process.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        time.sleep(rng.uniform(0, 1.0))  # somewhere inside an iteration
        live = _live_pids(log)
        while not live:  # between a resume's stage processes (the last kill's): wait for the new ones
            assert process.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
            live = _live_pids(log)
        victim = next(n for n in live if n.startswith(pick)) if pick else rng.choice(sorted(live))
        os.kill(live[victim], signal.SIGKILL)
        victims.append(victim)
    assert process.wait(timeout=400) == 0, log.read_text()[-3000:]
    text = log.read_text()
    assert "ref_forward-0 exited with -9: restarting it" in text  # stateless: restarted in place
    assert "recovering from the failure of actor_train-0" in text  # a trainer: the run resumed itself
    summary = json.loads((tmp_path / "chaos" / "summary.json").read_text())
    records = read_metrics(metrics)
    assert [r["iteration"] for r in records] == list(range(iterations)), victims  # each trained once
    assert all(r["staleness_max"] <= 1 for r in records)
    assert summary["samples_trained"] == iterations * per_iteration and summary["samples_dropped"] == 0
    assert len(summary["resumed_from"]) >= 1
    # what the stopped runs generated after their checkpoints was kept and trained as it was; only
    # a process killed between keeping a mini-batch and counting it (or the reverse) is off by one
    assert summary["samples_discarded_at_resume"] <= 8 * len(victims), (summary, victims)
    off = summary["samples_generated"] - summary["samples_trained"] - summary["samples_discarded_at_resume"]
    assert abs(off) <= 8 * victims.count("rollout-0"), (summary, victims)
