"""The vLLM rollout backend with a vision-language model (tiny Qwen2-VL and Qwen3-VL, CPU build):
image features as image embeddings (Qwen3-VL's with its deepstack features beside them), log-prob
parity with our forward with 0, 1 and 2 images per prompt, weight updates, and tiny end-to-end jobs
(Qwen2-VL's with multi-turn episodes whose observations show images).

vLLM's CPU environment has no torchvision, so its Qwen2-VL module imports only with the shim
`stream_rlhf/backends/vllm_shim/`: the client puts it on the engine's PYTHONPATH by itself, and
nothing here adds it.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from stream_rlhf.backends import vllm_protocol as wire
from stream_rlhf.backends.torch_engine import freeze_vision_tower
from stream_rlhf.backends.torch_rollout import SamplingParams
from stream_rlhf.backends.vllm_client import SHIM, VllmClient, engine_env
from stream_rlhf.backends.vllm_rollout import VllmOptions
from stream_rlhf.data.chat_template import encode_prompt
from stream_rlhf.data.images import ImageSpec, patchify
from stream_rlhf.data.shapes import problems
from stream_rlhf.models.checkpoint import build_tiny, load_policy, save_checkpoint
from stream_rlhf.models.model_config import TinyModelConfig, TinyVisionConfig
from stream_rlhf.models.packing import packed_forward, sequence_logprobs
from stream_rlhf.models.tokenizer import build_tokenizer
from stream_rlhf.models.vision_language import encode_images, image_feature_width, load_vision_tower
from stream_rlhf.samples import SampleImages
from stream_rlhf.stages.weight_sync import trained_parameters
from stream_rlhf.telemetry.stage_counts import read_stage_counts
from stream_rlhf.weights.shm_store import WeightStore
from stream_rlhf.weights.transport import Link, groups_folder
from tests.rl_tiny import VISION, tiny_job, write_job
from tests.test_rl_vllm import assert_every_sample_trained, run
from tests.vllm_env import vllm_python

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
PROMPTS = [("12+7=", 0), ("<image>how many?", 1), ("<image>and<image>same?", 2),
           ("<image>how many red?", 1), ("3+4=", 0), ("<image><image>how many?", 2)]
"""(text, images): every <image> is one image."""


@pytest.fixture(scope="module", params=["qwen2", "qwen3"])
def checkpoint(tmp_path_factory, request) -> Path:
    folder = tmp_path_factory.mktemp(f"tiny_vl_{request.param}")
    depth = 2 if request.param == "qwen3" else 1  # Qwen3-VL: deepstack features after block 0
    vision = TinyVisionConfig(depth=depth, embed_dim=32, num_heads=1, mlp_ratio=2, patch_size=8,
                              temporal_patch_size=2, spatial_merge_size=2)
    cfg = TinyModelConfig(architecture=request.param, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=128,
                          vision=vision)
    tokenizer = build_tokenizer(vision=True)
    save_checkpoint(build_tiny(cfg, tokenizer, seed=0), tokenizer, folder)
    return folder


@pytest.fixture(scope="module")
def engine(checkpoint):
    client = VllmClient(str(checkpoint), VllmOptions(max_model_len=128, cpu_cores=[0], max_images_per_prompt=2),
                        python=vllm_python(), start_timeout_s=300)
    yield client
    client.close()
    assert client.process.returncode == 0


@pytest.fixture(scope="module")
def batch(checkpoint) -> tuple[list[torch.Tensor], list[SampleImages]]:
    """PROMPTS as token ids (each image expanded to its image tokens) and their image features:
    32x32 shapes images (4 image tokens) and two of them side by side (8)."""
    pictures = [np.asarray(p.image()) for p in problems("train", 6, seed=0)]
    pictures[1::2] = [np.concatenate([p, q], axis=1) for p, q in zip(pictures[1::2], pictures[::2])]  # 32x64
    return encoded_prompts(checkpoint, PROMPTS, pictures)


def encoded_prompts(checkpoint: Path, prompts_and_counts: list[tuple[str, int]],
                    pictures: list[np.ndarray]) -> tuple[list[torch.Tensor], list[SampleImages]]:
    """Each (text, image count) as token ids with its images expanded to their image tokens, and
    their features from the checkpoint's vision tower; the images are `pictures`, in order."""
    config = load_policy(checkpoint).config
    spec = ImageSpec.from_vision_config(config.vision_config, min_pixels=32 * 32, max_pixels=64 * 64)
    tower = load_vision_tower(checkpoint)
    tokenizer = build_tokenizer(vision=True)
    vision_ids = (config.vision_start_token_id, config.image_token_id, config.vision_end_token_id)
    prompts, images, used = [], [], 0
    for text, count in prompts_and_counts:
        patched = [patchify(p, spec) for p in pictures[used:used + count]]
        used += count
        prompts.append(encode_prompt(tokenizer, text, [p.num_tokens for p in patched], vision_ids))
        grid = torch.stack([p.grid_thw for p in patched]) if patched else torch.zeros((0, 3), dtype=torch.long)
        features = encode_images(tower, torch.cat([p.pixel_values for p in patched]), grid) if patched else []
        images.append(SampleImages(
            torch.cat(features) if features else torch.zeros((0, image_feature_width(config))), grid))
    return prompts, images


def params(max_new_tokens: int = 5) -> SamplingParams:
    tokenizer = build_tokenizer(vision=True)
    return SamplingParams(1.0, 1.0, max_new_tokens, (tokenizer.eos_token_id,), tokenizer.pad_token_id)


def logprob_error(model: torch.nn.Module, prompts, images, gen) -> float:
    """Max |vLLM behaviour log-prob - our forward's| over the response tokens (temperature 1), ours
    (`sequence_logprobs`) renormalised without the image token: vLLM bans it from responses, as the
    torch backend does, and takes its log-probs after the ban."""
    sequences = [torch.cat([p, r]) for p, r in zip(prompts, gen.response_ids)]
    with torch.no_grad():
        ours, _ = sequence_logprobs(model, sequences, 1.0, images=images)
        logits = packed_forward(model, sequences, images=images)
    image_token = model.config.image_token_id
    errors = []
    for logp, logit, prompt, theirs in zip(ours, logits, prompts, gen.response_logp):
        start = len(prompt) - 1
        logp_image = logit[start:-1].log_softmax(-1)[:, image_token]  # (R,) where each response token was sampled
        errors.append((logp[start:] - torch.log1p(-logp_image.exp()) - theirs).abs().max().item())
    return max(errors)


def language_model_perturbed(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """A copy whose language model moved (as RL moves it; the vision tower stays frozen)."""
    model = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in freeze_vision_tower(model):
            p.add_(torch.randn(p.shape, generator=generator) * 0.05)
    return model


def test_the_engine_environment_imports_vllms_qwen2_vl():
    """The environment the client gives its engine process is enough for vLLM's Qwen2-VL module
    (which imports torchvision-backed transformers code) in vLLM's CPU environment."""
    python = vllm_python()
    env = engine_env(python)
    assert str(SHIM) in env["PYTHONPATH"].split(os.pathsep)  # .venv-vllm has no torchvision
    result = subprocess.run([python, "-c", "import vllm.model_executor.models.qwen2_vl"], env=env,
                            capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-3000:]


def test_behaviour_logprobs_equal_our_forward_with_0_1_and_2_images(engine, checkpoint, batch):
    prompts, images = batch
    assert sorted({len(i.grid_thw) for i in images}) == [0, 1, 2]
    gen = engine.generate(prompts, params(), seeds=list(range(len(prompts))), images=images)
    assert len(gen.response_ids) == len(prompts) and all(len(r) >= 1 for r in gen.response_ids)
    image_token = load_policy(checkpoint).config.image_token_id
    assert not any((r == image_token).any() for r in gen.response_ids)
    # measured 4.8e-7 (2.6e-2 against sequence_logprobs as it is: this random model gives image tokens ~1/52)
    assert logprob_error(load_policy(checkpoint).eval(), prompts, images, gen) < 1e-4


def test_updates_load_the_language_model_under_the_trainers_names(engine, checkpoint, batch, tmp_path):
    """v1: a whole-model file from `WeightStore.publish` (it keeps the tied head as lm_head.weight);
    v2: only the trained parameters, named as in memory (model.language_model.*, tied head as the
    embedding), as the broadcast transport sends them. Both through the shm transport's store."""
    prompts, images = batch
    seeds = list(range(len(prompts)))
    v1 = language_model_perturbed(load_policy(checkpoint).eval(), seed=1)
    store = WeightStore(tmp_path, "actor")
    store.publish(v1, version=1)
    assert logprob_error(v1, prompts, images, engine.generate(prompts, params(), seeds, images=images)) > 1e-2
    engine.join_weights("shm", Link(str(tmp_path), "actor", str(groups_folder(tmp_path)), "gloo", 1 << 16, 60.0),
                        "rollout-0", 2)
    engine.update(1, wire.RECEIVE, 1)
    assert logprob_error(v1, prompts, images, engine.generate(prompts, params(), seeds, images=images)) < 1e-4

    v2 = language_model_perturbed(v1, seed=2)
    trained = dict(trained_parameters(v2))
    assert "model.language_model.embed_tokens.weight" in trained and not any(".visual." in n for n in trained)
    store.publish({name: tensor.contiguous() for name, tensor in trained.items()}, version=2)
    engine.update(2, wire.RECEIVE, 2)
    gen = engine.generate(prompts, params(), seeds, images=images)
    assert engine.version == 2 and all((v == 2).all() for v in gen.token_versions)
    assert logprob_error(v2, prompts, images, gen) < 1e-4


EPISODES = {"env": {"factory": "tests.episode_envs:ShowsImage", "max_turns": 3, "max_episode_tokens": 96,
                    "max_observation_images": 1},
            "reward.function": None, "model.tiny.max_position_embeddings": 96, "rollout.vllm.block_size": 32}
"""The Qwen2-VL job's episodes: the first observation shows the episode's own image again."""


@pytest.mark.parametrize("architecture", ["qwen2", "qwen3"])
def test_tiny_multimodal_ppo_on_vllm(tmp_path, architecture):
    """The tiny vision-language job with rollout through vLLM, from its warm start (a checkpoint
    folder vLLM loads as it is). Qwen3-VL: single-turn, with deepstack features after vision block
    0. Qwen2-VL: episodes whose first observation shows a second image (`EPISODES`): the rollout
    process encodes each observation image once with the frozen tower it loads at the first one,
    vLLM takes every turn's images as embeddings and its prefix cache finds earlier turns' blocks,
    and the sample log lists both images."""
    name = f"vllm_mm_{architecture}"
    overrides = {"model.tiny.vision.depth": 2} if architecture == "qwen3" else EPISODES
    config = write_job(tmp_path / f"{name}.yaml", tiny_job(
        tmp_path, name, overlap_depth=1, broker={"shm_prefix": f"t_{name}"},
        **{**VISION, "rollout.backend": "vllm", "rollout.vllm.python": vllm_python(),
           "model.tiny.architecture": architecture, **overrides},
    ))
    summary = run(tmp_path, config)
    assert_every_sample_trained(summary, 2, 16)
    counts = read_stage_counts(tmp_path / name)
    assert counts["rollout"]["images_read"] == summary["images_seen"] == 32
    if architecture == "qwen3":
        return
    assert not summary["episodes_failed"], summary["episodes_failed"]
    prefix_cache = summary["episodes"]["prefix_cache"]
    assert 0 < prefix_cache["cached_tokens"] < prefix_cache["context_tokens"]
    episodes = counts["rollout"]["episodes"]
    assert episodes == 32 and counts["vision_prefetch"]["images_encoded"] == episodes  # the prompts' images
    # one observation image per episode (none when its first turn used up its tokens), each encoded once
    assert 0 < counts["rollout"]["images_encoded"] == episodes - counts["rollout"].get(
        "episodes_ended.max_episode_tokens", 0)
    samples = [json.loads(line) for line in (tmp_path / name / "samples.jsonl").read_text().splitlines()]
    shown = [s["images"] for s in samples if len(s["turns"]) > 1]
    assert shown and all(len(images) == 2 and images[0] == images[1] for images in shown)
