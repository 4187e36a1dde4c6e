"""The vLLM TurnSampler with a vision-language model (tiny Qwen2-VL, CPU build): multi-turn
episodes on prompts with 0, 1 and 2 images, scripted text observations after each turn, and
through the real episode loop an observation that shows an image; every policy token's behaviour
log-prob equals our full-sequence forward's (image features at the episode's image tokens, M-RoPE
positions), and the masks and rewards are the script's."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from stream_rlhf.backends.torch_rollout import SamplingParams
from stream_rlhf.backends.vllm_client import VllmClient
from stream_rlhf.backends.vllm_rollout import VllmOptions
from stream_rlhf.backends.vllm_turns import VllmTurnSampler
from stream_rlhf.data.images import ImageSpec, load_image
from stream_rlhf.data.shapes import problems
from stream_rlhf.envs.config import EnvConfig
from stream_rlhf.envs.environment import EpisodeStart
from stream_rlhf.envs.episode import Episode
from stream_rlhf.envs.episode_loop import EpisodeLoop
from stream_rlhf.envs.observation_images import ObservationImages
from stream_rlhf.envs.stepper import EnvStepper
from stream_rlhf.models.checkpoint import build_tiny, load_policy, save_checkpoint
from stream_rlhf.models.model_config import TinyModelConfig, TinyVisionConfig
from stream_rlhf.models.packing import packed_forward, sequence_logprobs
from stream_rlhf.models.tokenizer import build_tokenizer
from stream_rlhf.models.vision_language import encode_images, load_vision_tower
from stream_rlhf.samples import SampleImages
from tests.test_vllm_multimodal import encoded_prompts
from tests.test_vllm_turns import STAGGERED, observation, reward, run_episodes, turn_spans
from tests.vllm_env import vllm_python

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
PROMPTS = [("12+7=", 0), ("<image>how many?", 1), ("<image>and<image>same?", 2),
           ("<image>how many red?", 1), ("3+4=", 0), ("<image><image>how many?", 2)]
"""(text, images): every <image> is one image."""
MAX_MODEL_LEN = 128


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tiny_vl")
    vision = TinyVisionConfig(depth=1, embed_dim=32, num_heads=1, mlp_ratio=2, patch_size=8, temporal_patch_size=2,
                              spatial_merge_size=2)
    cfg = TinyModelConfig(architecture="qwen2", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                          max_position_embeddings=MAX_MODEL_LEN, vision=vision)
    tokenizer = build_tokenizer(vision=True)
    save_checkpoint(build_tiny(cfg, tokenizer, seed=0), tokenizer, folder)
    return folder


@pytest.fixture(scope="module")
def engine(checkpoint):
    client = VllmClient(str(checkpoint), VllmOptions(max_model_len=MAX_MODEL_LEN, cpu_cores=[0],
                                                     max_images_per_prompt=3, block_size=32),
                        python=vllm_python(), start_timeout_s=300)
    yield client
    client.close()
    assert client.process.returncode == 0


@pytest.fixture(scope="module")
def batch(checkpoint) -> tuple[list[torch.Tensor], list[SampleImages]]:
    """PROMPTS as token ids (each image expanded to its image tokens) and their image features."""
    return encoded_prompts(checkpoint, PROMPTS, [np.asarray(p.image()) for p in problems("train", 6, seed=0)])


def logprob_errors(model: torch.nn.Module, episode: Episode, images: SampleImages) -> list[float]:
    """Per policy turn: max |behaviour log-prob - our full-sequence forward's|, ours renormalised
    without the image token (vLLM bans it from responses and reports log-probs after the ban)."""
    sequence = torch.tensor(episode.prompt_ids + episode.token_ids)
    with torch.no_grad():
        (ours,), _ = sequence_logprobs(model, [sequence], 1.0, images=[images])
        (logits,) = packed_forward(model, [sequence], images=[images])
    start = len(episode.prompt_ids) - 1
    logp_image = logits[start:-1].log_softmax(-1)[:, model.config.image_token_id]  # (R,)
    ours = ours[start:] - torch.log1p(-logp_image.exp())
    behaviour = torch.tensor(episode.behavior_logp)
    return [(ours[a:b] - behaviour[a:b]).abs().max().item() for a, b in turn_spans(episode)]


def test_multi_turn_episodes_on_images_match_our_forward(engine, checkpoint, batch):
    prompts, images = batch
    tokenizer = build_tokenizer(vision=True)
    params = SamplingParams(1.0, 1.0, 6, (tokenizer.eos_token_id,), tokenizer.pad_token_id)
    turns = VllmTurnSampler(engine, params, (0, "rollout", 1, 0), MAX_MODEL_LEN)
    episodes, _ = run_episodes(turns, prompts, STAGGERED, images=images)
    assert turns.cached_tokens >= 32  # later turns found whole blocks (images included) of earlier ones
    model = load_policy(checkpoint).eval()
    image_token = model.config.image_token_id
    for key, (episode, script) in enumerate(zip(episodes, STAGGERED)):
        spans = turn_spans(episode)
        assert len(spans) == script.turns
        assert image_token not in episode.token_ids
        for turn, (_, b) in enumerate(spans[:-1]):
            assert episode.token_ids[b:b + len(observation(key, turn))] == observation(key, turn)
        assert episode.token_rewards()[[b - 1 for _, b in spans]].tolist() == pytest.approx(
            [reward(key, t) for t in range(script.turns)])
        assert max(logprob_errors(model, episode, images[key])) < 1e-4, key


def test_an_observation_image_reaches_vllm_as_embeddings_and_matches_our_forward(engine, checkpoint, batch, tmp_path):
    """Through the real episode loop, each episode's first observation shows a picture
    (`tests.episode_envs:ShowsImage`): the rollout side encodes it once with the checkpoint's frozen
    tower, later turns send vLLM the episode's prompt and observation images as embeddings, and every
    policy token's log-prob equals our forward's with the episode's images in token order."""
    prompts, images = batch
    picture = tmp_path / "shown.png"
    Image.fromarray(np.asarray(problems("eval", 1, seed=1)[0].image())).save(picture)
    config = load_policy(checkpoint).config
    spec = ImageSpec.from_vision_config(config.vision_config, min_pixels=32 * 32, max_pixels=64 * 64)
    tower = load_vision_tower(checkpoint)
    encoded: list[int] = []

    def encode(pixel_values: torch.Tensor, grid: torch.Tensor) -> list[torch.Tensor]:
        encoded.append(len(grid))
        return encode_images(tower, pixel_values, grid)

    tokenizer = build_tokenizer(vision=True)
    vision_ids = (config.vision_start_token_id, config.image_token_id, config.vision_end_token_id)
    cfg = EnvConfig(factory="tests.episode_envs:ShowsImage", options={"images": [str(picture)]}, max_turns=3,
                    max_episode_tokens=MAX_MODEL_LEN - 8, max_observation_images=1)
    loop = EpisodeLoop(cfg, lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
                       lambda text: tokenizer.encode(text, add_special_tokens=False), max_new_tokens=6)
    params = SamplingParams(1.0, 1.0, 6, (tokenizer.eos_token_id,), tokenizer.pad_token_id)
    sampler = VllmTurnSampler(engine, params, (0, "rollout", 2, 0), MAX_MODEL_LEN)
    stepper = EnvStepper(cfg.step_timeout_s, cfg.threads(len(prompts)))
    try:
        result = loop.run([EpisodeStart("q", "a") for _ in prompts], prompts, images, sampler, stepper,
                          ObservationImages(tokenizer, spec, vision_ids, encode))
    finally:
        sampler.close()
        stepper.close()
    assert result.ended == ["done"] * len(prompts), result.failures
    assert sum(encoded) == len(prompts)  # each episode's picture, once (those shown together in one call)
    shown = load_image(str(picture), spec)
    (features,) = encode_images(tower, shown.pixel_values, shown.grid_thw[None])
    model = load_policy(checkpoint).eval()
    for key, (episode, prompt_images) in enumerate(zip(result.episodes, images)):
        assert len(turn_spans(episode)) == 3 and config.image_token_id not in [
            t for t, policy in zip(episode.token_ids, episode.loss_mask) if policy]
        (observed,) = episode.observation_images
        torch.testing.assert_close(observed.features, features)
        merged = prompt_images.followed_by(observed)
        assert episode.token_ids.count(config.image_token_id) == len(features)
        assert max(logprob_errors(model, episode, merged)) < 1e-4, key
