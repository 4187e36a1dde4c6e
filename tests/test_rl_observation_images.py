"""A whole vision-language env job whose environment shows a second image in its first observation
(`tests.episode_envs:ShowsImage`, the episode's own image again), with every real stage in one
process: the rollout encodes each observation image once with its own policy's vision tower, and
every stage that reads features (the forwards, both trainers) sees each episode's two images, so
every sample is trained."""

from __future__ import annotations

import json

import pytest

from tests.test_rl_multimodal import run_multimodal

pytestmark = pytest.mark.slow
ENV = {"factory": "tests.episode_envs:ShowsImage", "max_turns": 3, "max_episode_tokens": 96}


def test_a_vlm_env_job_trains_every_episode_with_its_observation_images(tmp_path):
    cfg, records, counts = run_multimodal(tmp_path, "observed", env=ENV, overlap_depth=0,
                                          **{"reward.function": None, "model.tiny.max_position_embeddings": 96})
    episodes = cfg.iterations * cfg.rollout_batch.minibatches * cfg.rollout_batch.prompts_per_minibatch
    rollout = counts["rollout"]
    assert rollout["episodes"] == episodes
    assert not [key for key in rollout if key.startswith("episodes_failed.")], rollout
    # one observation image per episode (none when its first turn used up its tokens), each encoded once
    assert 0 < rollout["images_encoded"] == episodes - rollout.get("episodes_ended.max_episode_tokens", 0)
    assert counts["vision_prefetch"]["images_encoded"] == episodes  # the prompts' images
    assert [r["iteration"] for r in records] == [0, 1] and all(r["samples"] == 16 for r in records)
    # the sample log lists each episode's images: its prompt's, then its observation's (the same file)
    samples = [json.loads(line) for line in (tmp_path / "observed" / "samples.jsonl").read_text().splitlines()]
    shown = [s["images"] for s in samples if len(s["turns"]) > 1]
    assert shown and all(len(images) == 2 and images[0] == images[1] for images in shown)
