"""The engine-level agentic benchmarks: their columns run every mini-batch's episodes to their end
on a real model and environment, their tables; and (slow) their smoke runs end to end
(`agentic_rollout.py`, and `env_processes.py` with its environments in worker processes)."""

from __future__ import annotations

import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

from stream_rlhf.backends.torch_rollout import SamplingParams
from stream_rlhf.config import load_config
from stream_rlhf.envs.stepper import EnvStepper
from stream_rlhf.models.tokenizer import build_tokenizer
from stream_rlhf.rl.config import RLJobConfig
from tests.bench_run import REPO, run_bench_json
from tests.tiny_models import tiny_qwen2_config

sys.path.insert(0, str(REPO / "bench"))
import agentic_rollout  # noqa: E402  (bench/, beside pipeline.py which it imports)


@pytest.mark.parametrize(("schedule", "in_flight"), [("lockstep", 1), ("stream", 1), ("stream", 3)])
def test_a_column_runs_every_minibatch_to_its_end(schedule, in_flight):
    cfg = load_config(RLJobConfig, REPO / agentic_rollout.CONFIG, [f"env.schedule={schedule}",
                                                                    "rollout_batch.prompts_per_minibatch=2"])
    tokenizer = build_tokenizer()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_qwen2_config(len(tokenizer))).eval()
    work = agentic_rollout.minibatches(cfg, tokenizer, 4)
    assert [len(prompts) for _, prompts in work] == [2 * cfg.rollout_batch.samples_per_prompt] * 4
    params = SamplingParams(1.0, 1.0, 8, (tokenizer.eos_token_id,), tokenizer.pad_token_id)
    stepper = EnvStepper(10, 8)
    try:
        with torch.inference_mode():
            seconds, tokens, steps = agentic_rollout.run_column(cfg.env, model, tokenizer, params, work, in_flight,
                                                                stepper)
    finally:
        stepper.close()
    prompt_tokens = sum(len(p) for _, prompts in work for p in prompts)
    assert seconds > 0 and tokens > prompt_tokens  # every episode: its prompt and at least one turn
    assert steps >= sum(len(prompts) for _, prompts in work)  # every turn goes to the environment


def test_table():
    results = {"lockstep": {"episode_tokens_per_s": 1000.0, "s_per_minibatch": 0.2},
               "stream2": {"episode_tokens_per_s": 1500.0, "s_per_minibatch": 0.133}}
    table = agentic_rollout.format_table(results)
    assert "  / lockstep" in table and "1.50" in table and "1,500" in table


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bench_agentic_rollout_quick_json(tmp_path):
    figures, stdout = run_bench_json("bench/agentic_rollout.py", tmp_path, timeout_s=280)
    assert figures["baseline"] == "lockstep" and figures["lockstep_speedup"] == 1.0
    assert all(figures[f"{column}_episode_tokens_per_s"] > 0 for column in agentic_rollout.COLUMNS)
    assert "no trainer, no broker" in stdout


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bench_env_processes_quick_json(tmp_path):
    figures, stdout = run_bench_json("bench/env_processes.py", tmp_path, timeout_s=280)
    assert figures["baseline"] == "threads" and figures["threads_speedup"] == 1.0
    for column in ("free", "threads", "processes1", "processes2"):
        assert figures[f"{column}_episode_tokens_per_s"] > 0 and figures[f"{column}_env_steps_per_minibatch"] > 0
    assert "ms of pure Python per tool call" in stdout
