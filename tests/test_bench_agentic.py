"""The agentic benchmark: its runs' settings build, its figures from a run folder, its table and
JSON line; and (slow, once rollout runs episodes) its smoke run end to end."""

from __future__ import annotations

import json
import sys

import pytest

from stream_rlhf.config import load_config
from stream_rlhf.rl.config import RLJobConfig
from tests.bench_run import REPO, run_bench_json

sys.path.insert(0, str(REPO / "bench"))
import agentic  # noqa: E402  (bench/, beside pipeline.py which it imports)


def test_arguments_and_run_settings():
    args = agentic.parse_args(["--quick", "--json"])
    assert args.quick and args.json and not args.rewards
    stream = agentic.overrides("stream", agentic.FULL, "p")
    assert "env.schedule=stream" in stream and "env.options.latency_s=0.05" in stream
    assert "env.schedule=lockstep" in agentic.overrides("lockstep", agentic.FULL, "p")
    assert "env.minibatches_in_flight=1" in agentic.overrides("stream1", agentic.FULL, "p")

    def job(column: str) -> list[str]:
        return [s for s in agentic.overrides(column, agentic.FULL, "p")
                if not s.startswith(("env.schedule", "env.minibatches", "name=", "broker.shm"))]

    assert job("stream") == job("stream1") == job("lockstep")  # the same job but the schedule
    args = agentic.parse_args(["--vllm", sys.executable])
    on_vllm = agentic.vllm_settings(agentic.FULL, args.vllm)
    vllm_stream = agentic.overrides("stream", on_vllm, "p")
    assert {"rollout.backend=vllm", f"rollout.vllm.python={sys.executable}"} <= set(vllm_stream)
    assert "name=bench_agentic_vllm_stream" in vllm_stream
    cfg = load_config(RLJobConfig, REPO / agentic.CONFIG, vllm_stream)
    assert cfg.rollout.backend == "vllm" and cfg.rollout.vllm.block_size == 32
    assert "placement.rollout_cores=[0]" in vllm_stream  # on the CPU: rollout and the rest on a core each
    on_gpu = agentic.overrides("stream", agentic.replace(agentic.FULL, device="cuda"), "p")
    assert "placement.device=cuda" in on_gpu and not any(s.startswith("placement.rollout_cores") for s in on_gpu)
    assert load_config(RLJobConfig, REPO / agentic.CONFIG, on_gpu).placement.device == "cuda"
    assert agentic.parse_args(["--device", "cuda"]).device == "cuda"
    for column in ("tool", "no_tool"):  # the reward runs build as they are
        cfg = load_config(RLJobConfig, REPO / agentic.CONFIG, agentic.overrides(column, agentic.QUICK, "p", seed=1))
        assert cfg.seed == 1 and cfg.iterations == 3 and cfg.task.eval_prompts == 32
        assert (cfg.env is None) == (column == "no_tool")


def _run_folder(tmp_path, rollout_s: list[float], iteration_s: float, overlap: float = 0.0):
    """A run folder with 3 iterations of 2 mini-batches, 1000 tokens each; each rollout step
    starts `overlap` of the previous one's seconds before it ends."""
    tmp_path.mkdir()
    (tmp_path / "metrics.jsonl").write_text("".join(
        json.dumps({"iteration": i, "tokens": 1000, "iteration_s": iteration_s}) + "\n" for i in range(3)))
    events, start = [], 100.0
    for i, seconds in enumerate(rollout_s):
        events.append({"ph": "X", "cat": "step", "ts": int(start * 1e6), "dur": int(seconds * 1e6),
                       "args": {"stage": "rollout", "iteration": i // 2, "minibatch": i % 2}})
        start += seconds * (1 - overlap)
    events.append({"ph": "X", "cat": "step", "ts": 0, "dur": 9_000_000,  # another rank's share: not counted
                   "args": {"stage": "rollout", "iteration": 1, "rank": 1}})
    events.append({"ph": "X", "cat": "step", "ts": 0, "dur": 9_000_000,  # another stage: not counted
                   "args": {"stage": "actor_train", "iteration": 1}})
    (tmp_path / "trace.json").write_text(json.dumps({"traceEvents": events}))
    (tmp_path / "summary.json").write_text(json.dumps({"samples_trained": 192, "episodes_failed": {"timeout": 1}}))
    return tmp_path


def test_figures_table_and_json(tmp_path):
    lockstep = agentic.analyse(_run_folder(tmp_path / "a", [5.0, 5.0, 0.5, 0.5, 0.5, 0.5], 1.0), skip=1)
    assert lockstep["episode_tokens_per_s"] == pytest.approx(2000 / 2.0)  # iterations 1, 2 only
    assert lockstep["rollout_busy_s_per_minibatch"] == lockstep["minibatch_s"] == pytest.approx(0.5)
    assert lockstep["episodes_failed"] == {"timeout": 1} and lockstep["tokens_per_iteration"] == 1000
    # steps of 0.4 s, each starting halfway through the one before: 4 of them cover 1.0 s
    stream = agentic.analyse(_run_folder(tmp_path / "b", [1.0, 1.0, 0.4, 0.4, 0.4, 0.4], 0.5, overlap=0.5), skip=1)
    assert stream["episode_tokens_per_s"] == pytest.approx(2000 / 1.0)
    assert stream["minibatch_s"] == pytest.approx(0.4) and stream["rollout_busy_s_per_minibatch"] == pytest.approx(0.25)
    results = {"lockstep": lockstep, "stream1": lockstep, "stream": stream}
    table = agentic.format_table(results, agentic.FULL)
    assert "episode tokens/s" in table and "speedup (stream / lockstep episode tokens/s): 2.00" in table
    assert "PASS" in table
    rewards = {"tool": [{"before": 0.2, "after": 0.6}], "no_tool": [{"before": 0.1, "after": 0.2}]}
    assert "tool after > no_tool after: PASS" in agentic.format_rewards(rewards)
    line = agentic.figures(results, rewards, agentic.FULL)
    assert line["speedup"] == 2.0 and line["baseline"] == "lockstep" and line["rollout"] == "torch"
    assert line["device"] == "cpu"
    assert agentic.figures(results, rewards, agentic.vllm_settings(agentic.FULL, "py"))["rollout"] == "vllm"
    assert "rollout.backend=vllm" in agentic.format_table(results, agentic.vllm_settings(agentic.FULL, "py"))
    assert line["tool_eval_reward_after"] == [0.6] and line["no_tool_eval_reward_before"] == [0.1]
    json.dumps(line)
    with pytest.raises(RuntimeError, match="no iteration past the first 3"):
        agentic.analyse(tmp_path / "a", skip=3)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_bench_agentic_quick_json(tmp_path):
    figures, stdout = run_bench_json("bench/agentic.py", tmp_path, timeout_s=560)
    assert figures["baseline"] == "lockstep" and figures["speedup"] > 0
    assert figures["stream_episodes_failed"] == {} == figures["lockstep_episodes_failed"]
    assert figures["stream1_episodes_failed"] == {}
    assert "speedup (stream / lockstep" in stdout
