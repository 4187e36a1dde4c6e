"""The multimodal dataflow with every real stage, in one process on the real BrokerCore: the vision
stage encodes each image once and six stages read its features; without prefetch each of them
runs the vision tower itself; bad dataset lines are skipped and counted, never lost silently."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from stream_rlhf.broker.runtime.inprocess import InProcessBus
from stream_rlhf.config import build, import_dotted
from stream_rlhf.driver.dataflow import compile_job
from stream_rlhf.driver.warm_start import warm_start
from stream_rlhf.models.tokenizer import build_tokenizer
from stream_rlhf.rl.config import RLJobConfig
from stream_rlhf.rl.task_data import resolve_data
from stream_rlhf.telemetry.metrics import read_metrics
from stream_rlhf.telemetry.stage_counts import read_stage_counts, read_stage_details
from tests.rl_tiny import VISION, tiny_job, write_job
from tests.tiny_models import tiny_qwen2_5_vl

READERS = {"rollout", "ref_forward", "actor_forward", "critic_forward", "actor_train", "critic_train"}
"""The stages that need image features under PPO with overlap_depth 0, the one dataflow with every
forward (reward_forward reads only text)."""


def run_multimodal(tmp_path: Path, name: str, **overrides) -> tuple[RLJobConfig, list[dict], dict]:
    cfg = resolve_data(build(RLJobConfig, tiny_job(tmp_path, name, **{**VISION, **overrides})))
    flow = compile_job(cfg, str(warm_start(cfg)), str(tmp_path / f"{name}-weights"), vision_language=True)
    bus = InProcessBus(flow.topology, flow.broker, flow.admission)
    for stage_name, spec in flow.stages.items():
        bus.add(stage_name, import_dotted(spec.cls, "cls")(**spec.kwargs), spec.instances)
    stats = bus.run()
    assert stats["published.experience"] == cfg.iterations * cfg.rollout_batch.minibatches
    return cfg, read_metrics(Path(cfg.run_dir) / "metrics.jsonl"), read_stage_counts(Path(cfg.run_dir))


def test_each_image_is_encoded_once_while_six_stages_read_its_features(tmp_path):
    """With two data-parallel vision instances competing for the mini-batches."""
    cfg, records, counts = run_multimodal(tmp_path, "prefetch", overlap_depth=0, **{"vision.instances": 2})
    images = cfg.iterations * cfg.rollout_batch.minibatches * cfg.rollout_batch.prompts_per_minibatch
    assert counts["prompts"]["images_seen"] == images  # one image per prompt in the shapes task
    assert counts["vision_prefetch"]["images_encoded"] == images
    assert {stage for stage, c in counts.items() if c.get("images_read") == images} == READERS
    assert [stage for stage, c in counts.items() if c.get("images_encoded")] == ["vision_prefetch"]
    assert [r["iteration"] for r in records] == [0, 1] and all(r["samples"] == 16 for r in records)


def test_without_prefetch_every_stage_that_needs_features_runs_the_vision_tower(tmp_path):
    _, records, counts = run_multimodal(tmp_path, "no_prefetch", overlap_depth=0, **{"vision.prefetch": False})
    images = counts["prompts"]["images_seen"]
    assert "vision_prefetch" not in counts
    assert {stage for stage, c in counts.items() if c.get("images_encoded") == images} == READERS
    assert len(records) == 2


def test_a_qwen2_5_vl_checkpoint_folder_runs_with_the_same_code(tmp_path):
    """`model.path`: a Qwen2.5-VL folder (window attention in its vision tower) with its tokenizer."""
    folder = tmp_path / "qwen2_5_vl"
    tiny_qwen2_5_vl().save_pretrained(folder)
    build_tokenizer(vision=True).save_pretrained(folder)
    cfg, records, counts = run_multimodal(tmp_path, "qwen2_5", iterations=1, **{"model.path": str(folder)})
    assert warm_start(cfg) == folder
    assert counts["vision_prefetch"]["images_encoded"] == counts["prompts"]["images_seen"] == 16
    assert len(records) == 1 and (tmp_path / "qwen2_5" / "checkpoint" / "config.json").is_file()


def test_grpo_shares_a_prompts_images_between_its_samples(tmp_path):
    cfg, records, counts = run_multimodal(tmp_path, "grpo", **{"algorithm.advantage": "grpo",
                                                               "rollout_batch.samples_per_prompt": 2})
    prompts = cfg.iterations * cfg.rollout_batch.minibatches * cfg.rollout_batch.prompts_per_minibatch
    assert counts["vision_prefetch"]["images_encoded"] == prompts  # once per prompt, not per sample
    assert counts["prompts"]["images_seen"] == 2 * prompts
    assert all(r["samples"] == 32 for r in records)


def test_bad_lines_are_skipped_counted_and_reported(tmp_path):
    """A dataset of good shapes lines plus one line of each bad kind, with on_bad_sample: skip."""
    cfg = resolve_data(build(RLJobConfig, tiny_job(tmp_path, "source", **VISION)))
    source = Path(cfg.data.train)
    folder = tmp_path / "data"
    shutil.copytree(source.parent / "images", folder / "images")
    good = source.read_text().splitlines()[:20]  # fewer than the 32 prompts the run takes: every line is read
    (folder / "images" / "corrupt.png").write_bytes(b"\x89PNG\r\n\x1a\n not really")
    bad = [
        "{not json",
        json.dumps({"prompt": "<image>how many?", "images": ["images/missing.png"], "answer": "1"}),
        json.dumps({"prompt": "<image>how many?", "images": ["images/corrupt.png"], "answer": "1"}),
        json.dumps({"prompt": "how many?", "images": [json.loads(good[0])["images"][0]], "answer": "1"}),
    ]
    (folder / "train.jsonl").write_text("\n".join(good[:10] + bad + good[10:]) + "\n")
    shutil.copy(Path(cfg.data.eval), folder / "eval.jsonl")
    shutil.copytree(Path(cfg.data.eval).parent / "images", folder / "images", dirs_exist_ok=True)
    _, records, _ = run_multimodal(tmp_path, "skip", **{
        "data.train": str(folder / "train.jsonl"), "data.eval": str(folder / "eval.jsonl"),
        "data.on_bad_sample": "skip", "model.warm_start.steps": 2,
    })
    details = read_stage_details(Path(tmp_path / "skip"), "prompts")
    skipped = details[0]["skipped"]
    assert sum(skipped.values()) == 4, skipped
    examples = "\n".join(details[0]["skipped_examples"])
    assert "train.jsonl:11" in examples and "missing.png" in examples and "corrupt.png" in examples
    assert all(r["samples"] == 16 for r in records)  # every mini-batch still full


def test_a_bad_line_with_on_bad_error_names_the_file_and_line(tmp_path):
    cfg = resolve_data(build(RLJobConfig, tiny_job(tmp_path, "source", **VISION)))
    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "train.jsonl").write_text(
        json.dumps({"prompt": "<image>how many?", "images": ["nowhere.png"], "answer": "1"}) + "\n")
    shutil.copy(Path(cfg.data.eval), folder / "eval.jsonl")
    bad = build(RLJobConfig, tiny_job(tmp_path, "err", **{**VISION, "data.train": str(folder / "train.jsonl"),
                                                          "data.eval": str(folder / "eval.jsonl"),
                                                          "data.on_bad_sample": "error"}))
    with pytest.raises(ValueError, match=r"train\.jsonl:1: .*nowhere\.png"):
        warm_start(bad)


@pytest.mark.slow
def test_multimodal_run_writes_image_counts_in_its_summary(tmp_path):
    """`stream-rlhf run` on a tiny multimodal job, one process per stage (vision stage included)."""
    config = write_job(tmp_path / "mm.yaml", tiny_job(tmp_path, "mm", **VISION, broker={"shm_prefix": "t_mm"},
                                                      iterations=3, overlap_depth=1))
    result = subprocess.run([sys.executable, "-m", "stream_rlhf.cli", "run", str(config)],
                            check=False, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    summary = json.loads((tmp_path / "mm" / "summary.json").read_text())
    assert summary["samples_generated"] == summary["samples_trained"] == 3 * 2 * 8
    assert summary["images_seen"] == summary["images_encoded"] == 3 * 2 * 8
    assert summary["images_encoded_by_stage"] == {"vision_prefetch": 48}
    assert summary["lines_skipped"] == {"train": {}, "eval": {}} and summary["lines_skipped_examples"] == []
    assert {"eval_reward_before", "eval_reward_after"} <= summary.keys()
    assert not [n for n in os.listdir("/dev/shm") if n.startswith("t_mm")]


@pytest.mark.slow
def test_a_corrupt_image_stops_the_run_before_the_stages_even_with_no_warm_start(tmp_path):
    """No warm start reads the data first (model.path): the dataset's build in the driver decodes
    every image (`data/image_check.py`), so the run stops with the line in its message before any
    stage starts (before, the prompt source met the line and its stage failed, if it ever sampled it)."""
    cfg = resolve_data(build(RLJobConfig, tiny_job(tmp_path, "source", **VISION)))
    checkpoint = tmp_path / "checkpoint"
    shutil.copytree(warm_start(cfg), checkpoint)
    folder = tmp_path / "data"
    shutil.copytree(Path(cfg.data.train).parent / "images", folder / "images")
    good = Path(cfg.data.train).read_text().splitlines()[:3]
    corrupt = json.dumps({"prompt": "<image>how many?", "images": ["images/corrupt.png"], "answer": "1"})
    (folder / "images" / "corrupt.png").write_bytes(b"\x89PNG\r\n\x1a\n not really")
    (folder / "train.jsonl").write_text("\n".join([*good, corrupt]) + "\n")
    shutil.copy(Path(cfg.data.eval), folder / "eval.jsonl")
    config = write_job(tmp_path / "bad.yaml", tiny_job(tmp_path, "bad", **{
        **VISION, "model.path": str(checkpoint), "data.train": str(folder / "train.jsonl"),
        "data.eval": str(folder / "eval.jsonl"), "broker": {"shm_prefix": "t_bad"}}))
    result = subprocess.run([sys.executable, "-m", "stream_rlhf.cli", "run", str(config)],
                            check=False, capture_output=True, text=True, timeout=300)
    output = result.stdout + result.stderr
    assert result.returncode == 2, output[-3000:]
    assert f"data error: {folder / 'train.jsonl'}:4: image images/corrupt.png: cannot be decoded" in result.stderr
    assert "prompts-0" not in output and not (tmp_path / "bad" / "stage_counts").exists()
    assert not [n for n in os.listdir("/dev/shm") if n.startswith("t_bad")]


@pytest.mark.slow
def test_a_bad_line_read_by_the_warm_start_is_a_data_error_of_the_cli(tmp_path):
    cfg = resolve_data(build(RLJobConfig, tiny_job(tmp_path, "source", **VISION)))
    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "train.jsonl").write_text('{"prompt": "<image>how many?", "images": ["a.png"], "answer": "1"}\n{oops\n')
    shutil.copy(Path(cfg.data.eval), folder / "eval.jsonl")
    shutil.copytree(Path(cfg.data.eval).parent / "images", folder / "images")  # every image path names a file
    shutil.copy(folder / "images" / "eval-000000.png", folder / "a.png")
    config = write_job(tmp_path / "bad.yaml", tiny_job(tmp_path, "bad", **{
        **VISION, "data.train": str(folder / "train.jsonl"), "data.eval": str(folder / "eval.jsonl")}))
    result = subprocess.run([sys.executable, "-m", "stream_rlhf.cli", "run", str(config)],
                            check=False, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr[-3000:]
    assert f"data error: {folder / 'train.jsonl'}:2: not valid JSON" in result.stderr
