"""A whole vision-language env job with rollout on vLLM whose environment shows a second image in
its first observation (`tests.episode_envs:ShowsImage`, the episode's own image again): the rollout
process encodes each observation image once with the frozen vision tower it loads at the first
one, vLLM takes every turn's images as embeddings, and every sample is trained, its log lists both
images."""

from __future__ import annotations

import json

import pytest

from stream_rlhf.telemetry.stage_counts import read_stage_counts
from tests.rl_tiny import VISION, tiny_job, write_job
from tests.test_rl_vllm import assert_every_sample_trained, run
from tests.vllm_env import vllm_python

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
ENV = {"factory": "tests.episode_envs:ShowsImage", "max_turns": 3, "max_episode_tokens": 96,
       "max_observation_images": 1}


@pytest.mark.timeout(600)
def test_a_vlm_env_job_on_vllm_trains_every_episode_with_its_observation_images(tmp_path):
    name = "vllm_observed"
    config = write_job(tmp_path / f"{name}.yaml", tiny_job(
        tmp_path, name, overlap_depth=1, env=ENV, broker={"shm_prefix": f"t_{name}"},
        **{**VISION, "reward.function": None, "model.tiny.max_position_embeddings": 96, "rollout.backend": "vllm",
           "rollout.vllm": {"python": vllm_python(), "block_size": 32}}))
    summary = run(tmp_path, config)
    assert_every_sample_trained(summary, 2, 16)
    assert not summary["episodes_failed"], summary["episodes_failed"]
    prefix_cache = summary["episodes"]["prefix_cache"]  # later turns found earlier ones' blocks, images included
    assert 0 < prefix_cache["cached_tokens"] < prefix_cache["context_tokens"]
    counts = read_stage_counts(tmp_path / name)
    episodes = counts["rollout"]["episodes"]
    assert episodes == 32
    # one observation image per episode (none when its first turn used up its tokens), each encoded once
    assert 0 < counts["rollout"]["images_encoded"] == episodes - counts["rollout"].get(
        "episodes_ended.max_episode_tokens", 0)
    assert counts["vision_prefetch"]["images_encoded"] == episodes  # the prompts' images
    samples = [json.loads(line) for line in (tmp_path / name / "samples.jsonl").read_text().splitlines()]
    shown = [s["images"] for s in samples if len(s["turns"]) > 1]
    assert shown and all(len(images) == 2 and images[0] == images[1] for images in shown)
