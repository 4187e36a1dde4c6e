"""The bounded sample log (telemetry/sample_log.py): which samples, what each line holds, the bound
per iteration and the cut a resumed run makes, and its config key."""

from __future__ import annotations

import json
import math

import pytest
import torch

from stream_rlhf.broker.control.messages import Handle
from stream_rlhf.config import ConfigError, build
from stream_rlhf.experience import Experience
from stream_rlhf.models.tokenizer import build_tokenizer
from stream_rlhf.rl.config import RLJobConfig
from stream_rlhf.samples import Rollout, ragged
from stream_rlhf.stage import Batch
from stream_rlhf.telemetry.sample_log import IMAGE_PATHS, SAMPLES_FILE, SampleLog, SampleLogConfig, logged_indices
from tests.rl_tiny import tiny_job

TOKENIZER = build_tokenizer(vision=True)


@pytest.mark.parametrize(("num_samples", "per_minibatch", "expected"), [
    (8, 2, [0, 7]), (8, 3, [0, 4, 7]), (3, 5, [0, 1, 2]), (5, 1, [0]), (5, 0, []), (1, 2, [0]),
])
def test_logged_indices_spread_over_the_minibatch(num_samples, per_minibatch, expected):
    assert logged_indices(num_samples, per_minibatch) == expected


def _ids(text: str) -> list[int]:
    return TOKENIZER.encode(text, add_special_tokens=False)


def _batch(iteration: int, minibatch: int, policy_version: int, num_samples: int, images: bool) -> Batch:
    """A joined experience mini-batch: prompt (an image's token run, then text) + response "k<eos>"."""
    image = _ids("<|vision_start|>") + _ids("<|image_pad|>") * 3 + _ids("<|vision_end|>") if images else []
    prompts = [[TOKENIZER.bos_token_id, *image, *_ids(f"{n}+{minibatch}=?")] for n in range(num_samples)]
    responses = [_ids(str(n % 10)) + [TOKENIZER.eos_token_id] for n in range(num_samples)]
    rollout = Rollout(
        sequences=[torch.tensor(p + r) for p, r in zip(prompts, responses)],
        prompt_lens=torch.tensor([len(p) for p in prompts], dtype=torch.int32),
        behavior_logp=[torch.tensor([-0.1 * n, -0.5]) for n in range(num_samples)],
        group_ids=torch.arange(num_samples),
    )
    tensors = {**rollout.to_tensors(), **ragged("ref_logp", [torch.tensor([-0.2, -0.4])] * num_samples),
               "scores": torch.arange(num_samples, dtype=torch.float32) / 10}
    metadata = {IMAGE_PATHS: [f"/data/{minibatch}-{n}.png" for n in range(num_samples)]} if images else {}
    handle = Handle(f"h{iteration}-{minibatch}", "experience", iteration, minibatch, policy_version, num_samples,
                    metadata=metadata)
    return Batch(handle, tensors)


def _log_iteration(log: SampleLog, iteration: int, version: int, images: bool = False) -> None:
    batches = [_batch(iteration, m, version - m, 5, images) for m in range(2)]
    exp = Experience.from_batches(batches)
    advantages = torch.arange(exp.mask.numel(), dtype=torch.float32).reshape(exp.mask.shape) * exp.mask
    log.write(batches, exp, advantages, exp.kl("k1"), iteration)


def _lines(tmp_path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / SAMPLES_FILE).read_text().splitlines()]


def test_a_line_holds_the_sample_token_by_token(tmp_path):
    log = SampleLog(tmp_path, SampleLogConfig(per_minibatch=2), TOKENIZER)
    _log_iteration(log, iteration=3, version=3, images=True)
    lines = _lines(tmp_path)
    assert [(r["minibatch"], r["sample"]) for r in lines] == [(0, 0), (0, 4), (1, 0), (1, 4)]
    last = lines[-1]  # experience row 9: mini-batch 1 (policy v2, trained by v3), sample 4
    assert last["iteration"] == 3 and last["policy_version"] == 2 and last["staleness"] == 1
    assert last["reward"] == pytest.approx(0.4)
    assert last["prompt"] == "<image>4+1=?"
    assert last["response"] == "4"
    assert last["tokens"] == ["4", "<eos>"]
    assert last["logprob"] == pytest.approx([-0.4, -0.5])
    assert last["advantage"] == [18.0, 19.0]  # row 9 of the (10, 2) arange
    assert last["kl"] == pytest.approx([-0.2, -0.1])  # k1: behaviour - reference
    assert last["images"] == ["/data/1-4.png"]


def test_text_samples_have_no_images_and_no_kl_without_a_reference(tmp_path):
    log = SampleLog(tmp_path, SampleLogConfig(per_minibatch=1), TOKENIZER)
    batch = _batch(0, 0, 0, 3, images=False)
    del batch.tensors["ref_logp"], batch.tensors["ref_logp_lens"]
    exp = Experience.from_batches([batch])
    log.write([batch], exp, torch.zeros_like(exp.mask), exp.kl("k1"), 0)
    (line,) = _lines(tmp_path)
    assert line["prompt"] == "0+0=?" and line["images"] == [] and line["kl"] is None


def test_the_log_is_bounded_per_iteration_and_cut_back_on_resume(tmp_path):
    cfg = SampleLogConfig(per_minibatch=3)
    log = SampleLog(tmp_path, cfg, TOKENIZER)
    for iteration in range(4):
        _log_iteration(log, iteration, iteration)
    per_iteration = {i: sum(r["iteration"] == i for r in _lines(tmp_path)) for i in range(4)}
    assert per_iteration == {i: 3 * 2 for i in range(4)}  # per_minibatch * minibatches
    with (tmp_path / SAMPLES_FILE).open("a") as f:
        f.write('{"iteration": 3, "torn')  # a run stopped mid-line
    resumed = SampleLog(tmp_path, cfg, TOKENIZER, start_version=2)
    assert sorted({r["iteration"] for r in _lines(tmp_path)}) == [0, 1]
    _log_iteration(resumed, 2, 2)
    assert [r["iteration"] for r in _lines(tmp_path)].count(2) == 6
    SampleLog(tmp_path, cfg, TOKENIZER)  # a fresh run of the folder starts empty
    assert (tmp_path / SAMPLES_FILE).read_text() == ""


def test_every_float_is_rounded_and_finite(tmp_path):
    log = SampleLog(tmp_path, SampleLogConfig(), TOKENIZER)
    _log_iteration(log, 0, 0)
    for record in _lines(tmp_path):
        for value in record["logprob"] + record["advantage"] + record["kl"] + [record["reward"]]:
            assert math.isfinite(value) and round(value, 4) == value


def test_samples_log_config_key(tmp_path):
    assert build(RLJobConfig, tiny_job(tmp_path, "t")).samples_log.per_minibatch == 2
    off = build(RLJobConfig, tiny_job(tmp_path, "t", **{"samples_log.per_minibatch": 0}))
    assert off.samples_log.per_minibatch == 0
    with pytest.raises(ConfigError, match=r"samples_log.per_minibatch=-1: must be >= 0"):
        build(RLJobConfig, tiny_job(tmp_path, "t", **{"samples_log.per_minibatch": -1}))
    with pytest.raises(ConfigError, match=r"samples_log.every: unknown key"):
        build(RLJobConfig, tiny_job(tmp_path, "t", **{"samples_log.every": 3}))
