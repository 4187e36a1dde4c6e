"""Images in observations (vision-language episodes on the torch rollout backend): the real episode
loop and torch turn sampler over a tiny Qwen2-VL whose environment shows images in its first
observation. Every policy token's behaviour log-prob is what the trainer's packed forward of the
finished episode, with the merged images, recomputes; the rollout handle carries the observation
images so that `ImageInputs.of` and `Experience` give each episode's whole image list; a text
policy, or observations past env.max_observation_images, fail such an episode as "malformed"."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from stream_rlhf.backends.episode_sampler import TorchTurnSampler
from stream_rlhf.backends.torch_rollout import SamplingParams
from stream_rlhf.broker.control.messages import Handle
from stream_rlhf.config import build
from stream_rlhf.data.images import ImageSpec, load_image
from stream_rlhf.envs.config import EnvConfig
from stream_rlhf.envs.environment import EpisodeStart, Observation
from stream_rlhf.envs.episode_handle import episode_tensors
from stream_rlhf.envs.episode_loop import EpisodeLoop, EpisodeResult
from stream_rlhf.envs.observation_images import ObservationImages
from stream_rlhf.envs.stepper import EnvStepper
from stream_rlhf.experience import Experience
from stream_rlhf.models.checkpoint import save_checkpoint
from stream_rlhf.models.packing import sequence_logprobs
from stream_rlhf.models.vision_language import encode_images
from stream_rlhf.rl.config import RLJobConfig
from stream_rlhf.samples import SampleImages, ragged
from stream_rlhf.stage import Batch
from stream_rlhf.stages.images import ImageInputs
from stream_rlhf.stages.job_context import JobContext
from stream_rlhf.stages.topics import TOPICS
from stream_rlhf.telemetry.stage_counts import StageCounts
from tests.rl_tiny import VISION, tiny_job
from tests.test_vision_language import END, IMAGE, START, TOKENIZER, build_model, encode, make_sample

ATOL = 1e-5
TEMPERATURE = 0.7
PARAMS = SamplingParams(temperature=TEMPERATURE, max_new_tokens=4, stop_token_ids=(TOKENIZER.eos_token_id,),
                        pad_token_id=TOKENIZER.pad_token_id)


@pytest.fixture(scope="module")
def vlm() -> torch.nn.Module:
    return build_model("qwen2_vl").eval()


@pytest.fixture(scope="module")
def pictures(tmp_path_factory) -> list[str]:
    """Two image files: 32x32 (4 image tokens at patch 8, merge 2) and 64x32 (8 tokens)."""
    folder = tmp_path_factory.mktemp("pictures")
    g = np.random.default_rng(0)
    paths = []
    for name, (height, width) in {"square.png": (32, 32), "wide.png": (32, 64)}.items():
        Image.fromarray(g.integers(0, 255, (height, width, 3), dtype=np.uint8)).save(folder / name)
        paths.append(str(folder / name))
    return paths


def spec(vlm: torch.nn.Module) -> ImageSpec:
    return ImageSpec.from_vision_config(vlm.config.vision_config, min_pixels=256, max_pixels=2048)


def run_episodes(vlm: torch.nn.Module, env: dict, observe: ObservationImages | None, max_observation_images: int = 4
                 ) -> tuple[EpisodeResult, list[torch.Tensor], list[SampleImages]]:
    """Three episodes (prompt images: one, none, two) in `tests.episode_envs:ShowsImage` with `env`'s
    options; the result, the prompts and the prompts' encoded images."""
    g = torch.Generator().manual_seed(4)
    samples = [make_sample(g, [2, 3], [(1, 4, 4)]), make_sample(g, [4], []),
               make_sample(g, [1, 2, 2], [(1, 4, 4), (1, 4, 6)])]
    prompts, images = [s.input_ids for s in samples], [encode(vlm, s) for s in samples]
    cfg = EnvConfig(factory="tests.episode_envs:ShowsImage", options=env, max_turns=3, max_episode_tokens=96,
                    max_observation_images=max_observation_images)
    loop = EpisodeLoop(cfg, lambda ids: TOKENIZER.decode(ids, skip_special_tokens=True),
                       lambda text: TOKENIZER.encode(text, add_special_tokens=False), PARAMS.max_new_tokens)
    sampler = TorchTurnSampler(vlm, 3, 96, PARAMS, (0,), policy_version=2)
    stepper = EnvStepper(cfg.step_timeout_s, cfg.workers)
    try:
        result = loop.run([EpisodeStart("q", "a") for _ in samples], prompts, images, sampler, stepper, observe)
    finally:
        sampler.close()
        stepper.close()
    return result, prompts, images


def observer(vlm: torch.nn.Module) -> ObservationImages:
    return ObservationImages(TOKENIZER, spec(vlm), (START, IMAGE, END),
                             lambda pixel_values, grid: encode_images(vlm, pixel_values, grid))


@pytest.mark.parametrize("marker", [False, True])
def test_observation_images_record_the_trainers_log_probs_and_reach_every_consumer(vlm, pictures, marker, tmp_path):
    result, prompts, prompt_images = run_episodes(vlm, {"images": pictures, "marker": marker}, observer(vlm))
    assert result.ended == ["done"] * 3, result.failures
    grids = torch.tensor([[1, 4, 4], [1, 4, 8]])
    own = [load_image(path, spec(vlm)) for path in pictures]
    features = torch.cat(encode_images(vlm, torch.cat([im.pixel_values for im in own]), grids))  # (12, H)
    runs = [START, *[IMAGE] * 4, END, START, *[IMAGE] * 8, END]
    for episode in result.episodes:
        first = episode.turn_ends[0] + 1  # the first observation: the images' runs in place, no loss
        observation = episode.token_ids[first:episode.loss_mask.index(1, first)]
        at = observation.index(START)
        assert observation[at:at + len(runs)] == runs and (at > 0) == marker
        assert episode.policy_versions[first:first + len(observation)] == [-1] * len(observation)
        assert len(episode.observation_images) == 1
        torch.testing.assert_close(episode.observation_images[0].features, features)
        assert torch.equal(episode.observation_images[0].grid_thw, grids)

    # the rollout handle (with the vision handle the broker joins it with) and its readers
    tensors = episode_tensors(result.episodes)
    TOPICS["rollout"].check(tensors, 3)
    per_image = [f for images in prompt_images for f in torch.split(
        images.features, [t * h * w // 4 for t, h, w in images.grid_thw.tolist()])]
    vision = {"image_features": torch.cat(per_image), "image_tokens": torch.tensor([len(f) for f in per_image]),
              "image_grid_thw": torch.cat([images.grid_thw for images in prompt_images]),
              **ragged("prompt_images", [torch.tensor([0]), torch.zeros(0, dtype=torch.long), torch.tensor([1, 2])])}
    joined = {**vision, **tensors, "group_ids": torch.arange(3), "scores": torch.zeros(3)}
    job = JobContext(build(RLJobConfig, tiny_job(tmp_path, "obs", **VISION)), "unused", "unused", vision_language=True)
    merged = ImageInputs(job, StageCounts(".", "r", "r", write=False)).of(joined)
    sequences = [torch.tensor(e.prompt_ids + e.token_ids) for e in result.episodes]
    for images, prompt, sequence in zip(merged, prompt_images, sequences):
        torch.testing.assert_close(images.features, torch.cat([prompt.features, features]))
        assert torch.equal(images.grid_thw, torch.cat([prompt.grid_thw, grids]))
        assert int((sequence == IMAGE).sum()) == len(images.features)
    handle = Handle("h", "experience", 0, 0, policy_version=2, num_samples=3)
    experience = Experience.from_batches([Batch(handle, joined)], [merged])
    assert experience.images is not None and all(a is b for a, b in zip(experience.images, merged))

    # the trainer's forward: packed sequences with the merged images
    with torch.no_grad():
        recomputed, _ = sequence_logprobs(vlm, sequences, temperature=TEMPERATURE, images=merged)
    for episode, prompt, again in zip(result.episodes, prompts, recomputed):
        policy = torch.tensor(episode.loss_mask, dtype=torch.bool)
        behaviour = torch.tensor(episode.behavior_logp)[policy]
        torch.testing.assert_close(behaviour, again[len(prompt) - 1:][policy], atol=ATOL, rtol=0)


def test_text_episodes_add_no_image_fields(vlm):
    result, _, _ = run_episodes(vlm, {"images": [], "turns": 1}, observer(vlm))
    assert result.ended == ["done"] * 3
    assert not any(name.startswith("episode_image") for name in episode_tensors(result.episodes))


@pytest.mark.parametrize("refusal", ["text policy", "past the limit"])
def test_an_observation_the_rollout_cannot_take_fails_the_episode_as_malformed(vlm, pictures, refusal):
    """A text policy's rollout has no `observe`; two images in an episode limited to one are too many
    (counted before anything is read or encoded)."""
    encoded = []
    observe = None if refusal == "text policy" else ObservationImages(
        TOKENIZER, spec(vlm), (START, IMAGE, END), lambda pixel_values, grid: encoded.append(grid) or [])
    result, _, _ = run_episodes(vlm, {"images": pictures}, observe, max_observation_images=1)
    assert result.ended == ["failed:malformed"] * 3 and not encoded
    assert [e.turns for e in result.episodes] == [1] * 3  # the turn before the observation is kept
    expected = ("need a vision-language policy" if refusal == "text policy"
                else "would show 2 images, more than env.max_observation_images=1")
    assert all(expected in failure for failure in result.failures), result.failures
    assert not any(name.startswith("episode_image") for name in episode_tensors(result.episodes))


def test_a_stage_without_the_policy_encodes_observation_images_with_a_tower_loaded_at_first_use(vlm, pictures,
                                                                                                 tmp_path):
    """vLLM's rollout holds no policy: `ImageInputs.encode` loads the checkpoint's frozen vision tower
    at its first call, gives the policy's own features, and counts each image; a text job's refuses."""
    save_checkpoint(vlm, TOKENIZER, tmp_path / "vlm")
    cfg = build(RLJobConfig, tiny_job(tmp_path, "obs", **VISION))
    counts = StageCounts(str(tmp_path), "rollout", "rollout-0", write=False)
    images = ImageInputs(JobContext(cfg, str(tmp_path / "vlm"), "unused", vision_language=True), counts)
    assert images.tower is None  # the vision stage encodes the prompts' images: nothing loaded yet
    own = [load_image(path, spec(vlm)) for path in pictures]
    pixel_values, grid = torch.cat([im.pixel_values for im in own]), torch.stack([im.grid_thw for im in own])
    for got, expected in zip(images.encode(pixel_values, grid), encode_images(vlm, pixel_values, grid), strict=True):
        torch.testing.assert_close(got, expected)
    assert counts.values == {"images_encoded": 2, "encoder_calls": 1}
    text = ImageInputs(JobContext(cfg, "unused", "unused", vision_language=False), counts)
    with pytest.raises(ValueError, match="the policy is a text model"):
        text.encode(pixel_values, grid)


def test_observations_read_together_go_through_one_call_of_the_tower(vlm, pictures):
    """`many`: the ids and features each observation gets alone, from one call of `encode`; one that
    cannot be read gets its own error, and an `encode` that refuses fails each of the others."""
    calls = []

    def encode(pixel_values, grid):
        calls.append(len(grid))
        return encode_images(vlm, pixel_values, grid)

    observe = ObservationImages(TOKENIZER, spec(vlm), (START, IMAGE, END), encode)
    missing = str(Path(pictures[0]).parent / "missing.png")
    batch = [Observation("a", images=(pictures[0],)), Observation("b", images=(missing,)),
             Observation("c <image> d <image>", images=tuple(pictures))]
    ready = observe.many(batch)
    assert calls == [3]  # the first's image and the third's two
    assert isinstance(ready[1], ValueError) and "missing.png: file not found" in str(ready[1])
    for got, observation in zip((ready[0], ready[2]), (batch[0], batch[2])):
        ids, images = observer(vlm)(observation)
        assert got[0] == ids and torch.equal(got[1].grid_thw, images.grid_thw)
        torch.testing.assert_close(got[1].features, images.features, atol=ATOL, rtol=0)

    def refuse(pixel_values, grid):
        raise ValueError("the policy is a text model: it takes no images")

    refused = ObservationImages(TOKENIZER, spec(vlm), (START, IMAGE, END), refuse).many([batch[0], batch[2]])
    assert all(isinstance(r, ValueError) and "text model" in str(r) for r in refused)


def test_an_observation_text_must_place_every_image_or_none(vlm, pictures):
    observe = observer(vlm)
    with pytest.raises(ValueError, match="Observation.text has 1 <image> markers for 2 image"):
        observe(Observation("a <image> b", images=tuple(pictures)))
    with pytest.raises(ValueError, match="missing.png: file not found"):
        observe(Observation("a", images=(str(Path(pictures[0]).parent / "missing.png"),)))
