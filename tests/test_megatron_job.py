"""A whole RL job whose actor trains on the megatron backend (tp 2 over a group of two ranks, in
micro-batches of `actor.micro_batch_tokens`) and whose reference forward runs on it too: every
generated sample is trained, each iteration's weights reach rollout, and the first iteration (same
starting weights, same samples) trains to the torch backend's loss and gradient norm (one pass
there). Needs the `megatron` extra."""

from __future__ import annotations

import json
import os
import re

import pytest

from stream_rlhf.telemetry.metrics import read_metrics
from tests.test_rl_job import leftover_shm, start_run

pytest.importorskip("megatron.core", reason="needs the megatron extra: pip install -e '.[megatron]'")
pytestmark = pytest.mark.slow

JOB = ("algorithm.advantage=grpo", "rollout_batch.samples_per_prompt=2", "schedule=sync", "overlap_depth=0",
       "iterations=3", "model.tiny.num_key_value_heads=2", "algorithm.kl.placement=loss")
"""GRPO, sync, on-policy: iteration i's samples come from policy version i; 2 key/value heads so tp 2
splits them; the KL in the loss, not the reward: GRPO normalises rewards by their group's spread,
which for a group of equal scores is the KL alone, so a 1e-7 difference in the reference
log-probs would move the advantages by O(1)."""
MEGATRON = ("placement.stages={actor_train: {ranks: 2, backend: megatron, megatron: {tp: 2}}, "
            "ref_forward: {ranks: 2, backend: megatron, megatron: {tp: 2}}}")
MICRO = "actor.micro_batch_tokens=96"
"""A few of the tiny task's samples per micro-batch: a step of the megatron actor, and the reference
forward, pass in several."""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="a group of two ranks needs two cores (one each)")
def test_a_job_trains_its_actor_on_megatron_with_tp_2(tmp_path):
    megatron, megatron_log = start_run(tmp_path, "megatron", *JOB, MEGATRON, MICRO)
    assert megatron.wait(timeout=300) == 0, megatron_log.read_text()[-3000:]
    torch_run, torch_log = start_run(tmp_path, "torch", *JOB)
    assert torch_run.wait(timeout=300) == 0, torch_log.read_text()[-3000:]
    text = megatron_log.read_text()
    for stage in ("actor_train", "ref_forward"):
        assert re.search(rf"{stage}-0 rank 1 of 2 \(pid \d+\) follows its leader on cpu", text), stage
        assert f"{stage}: megatron engine, fp32, micro-batches of at most 96 tokens" in text, stage
    summary = json.loads((tmp_path / "megatron" / "summary.json").read_text())
    # iterations x mini-batches x prompts x samples
    assert summary["samples_trained"] == summary["samples_generated"] == 3 * 2 * 8 * 2
    assert summary["samples_dropped"] == 0
    records = read_metrics(tmp_path / "megatron" / "metrics.jsonl")
    assert [r["iteration"] for r in records] == [0, 1, 2]
    assert [r["staleness_max"] for r in records] == [0, 0, 0]  # rollout sampled iteration i with version i
    assert [r["policy_version"] for r in records] == [1, 2, 3]
    first = read_metrics(tmp_path / "torch" / "metrics.jsonl")[0]
    assert records[0]["reward"] == first["reward"]  # both sampled with the warm start's weights
    for key in ("loss", "grad_norm", "kl", "entropy"):
        assert records[0][key] == pytest.approx(first[key], abs=1e-4), key
    assert (tmp_path / "megatron" / "checkpoint" / "model.safetensors").is_file()
    assert not leftover_shm("t_megatron")


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="a group of two ranks needs two cores (one each)")
def test_a_job_trains_its_actor_on_megatron_in_bf16_over_two_pipeline_stages(tmp_path):
    """`precision: bf16` reaches the megatron stages (bf16 activations between pipeline stages: a
    two-layer model, one per stage), and every sample still trains."""
    pipeline = ("placement.stages={actor_train: {ranks: 2, backend: megatron, megatron: {pp: 2}}, "
                "ref_forward: {ranks: 2, backend: megatron, megatron: {pp: 2}}}")
    run, log = start_run(tmp_path, "bf16", *JOB, pipeline, MICRO, "precision=bf16", "model.tiny.num_hidden_layers=2")
    assert run.wait(timeout=300) == 0, log.read_text()[-3000:]
    text = log.read_text()
    for stage in ("actor_train", "ref_forward"):
        assert f"{stage}: megatron engine, bf16, micro-batches of at most 96 tokens" in text, stage
    summary = json.loads((tmp_path / "bf16" / "summary.json").read_text())
    assert summary["samples_trained"] == summary["samples_generated"] == 3 * 2 * 8 * 2
    records = read_metrics(tmp_path / "bf16" / "metrics.jsonl")
    assert [r["policy_version"] for r in records] == [1, 2, 3]
    assert all(0 < r["grad_norm"] < 1e3 for r in records)
    assert not leftover_shm("t_bf16")
