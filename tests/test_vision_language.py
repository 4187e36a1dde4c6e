"""Vision-language models fed precomputed image features give what the full model gives from pixels.

Every comparison is against the plain Hugging Face forward `model(input_ids, pixel_values=...,
image_grid_thw=..., mm_token_type_ids=...)`, for tiny Qwen2-VL, Qwen2.5-VL and Qwen3-VL (deepstack) models, in fp32:
logits, log-probs and values to atol 1e-5; behaviour log-probs of generation (KV cache, left
padding) to atol 1e-4, as for text models in test_torch_rollout.py.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import pytest
import torch

from stream_rlhf.backends.decode_attention import use_decode_attention
from stream_rlhf.backends.torch_rollout import SamplingParams, generate
from stream_rlhf.models.checkpoint import build_tiny, load_critic
from stream_rlhf.models.model_config import TinyModelConfig, TinyVisionConfig
from stream_rlhf.models.packing import pack, packed_forward, sequence_logprobs
from stream_rlhf.models.tokenizer import VISION_TOKENS, build_tokenizer
from stream_rlhf.models.vision_language import (
    VisionLanguageCritic,
    embed_with_images,
    encode_images,
    image_feature_width,
    is_vision_language_model,
    language_model_inputs,
    load_vision_tower,
    mrope_positions,
    vision_tower,
)
from stream_rlhf.samples import SampleImages
from stream_rlhf.weights.shm_store import WeightStore
from tests.test_packing import spans
from tests.tiny_models import tiny_qwen2_5_vl

ATOL = 1e-5  # logits, log-probs, values: packed with precomputed features vs full-model forwards
ATOL_GENERATE = 1e-4  # behaviour log-probs (KV-cached, left-padded decode) vs a packed recomputation
PATCH_DIM = 3 * 2 * 8 * 8  # channels * temporal_patch_size * patch_size**2
TOKENIZER = build_tokenizer(vision=True)
START, IMAGE, END = TOKENIZER.convert_tokens_to_ids(list(VISION_TOKENS))
TEXT_IDS = (4, START)  # [low, high) of the ordinary text tokens (after <pad> <bos> <eos> <unk>)

# each sample: text lengths around its images, and the images' grids (t, h, w) in patches (merge 2)
LAYOUTS = [
    ([3, 5], [(1, 4, 4)]),  # 1 image, 4 tokens
    ([2, 1, 4], [(1, 4, 6), (1, 8, 4)]),  # 2 images of different sizes: 6 and 8 tokens
    ([1, 2], [(1, 6, 6)]),  # 9 tokens; odd merged grid (Qwen2.5-VL pads its attention windows)
    ([7], []),  # text only
    ([2, 3, 1], [(1, 4, 4), (1, 6, 4)]),
]


KINDS = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"]


def build_model(kind: str) -> torch.nn.Module:
    if kind == "qwen2_5_vl":
        return tiny_qwen2_5_vl()
    architecture = "qwen3" if kind == "qwen3_vl" else "qwen2"
    vision = TinyVisionConfig(depth=3)  # Qwen3-VL: deepstack features after blocks 0 and 1
    return build_tiny(TinyModelConfig(architecture=architecture, vision=vision), TOKENIZER, seed=0)


@pytest.fixture(scope="module", params=KINDS)
def vlm(request) -> torch.nn.Module:
    return build_model(request.param).eval()


@dataclass
class Sample:
    input_ids: torch.Tensor  # (L,)
    pixel_values: torch.Tensor  # (patches, PATCH_DIM)
    grid_thw: torch.Tensor  # (n_images, 3)

    def full_logits(self, model: torch.nn.Module, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """(L, V) logits of the plain full-model forward from pixels (`input_ids` may extend the prompt)."""
        ids = self.input_ids if input_ids is None else input_ids
        if not len(self.grid_thw):
            return model(input_ids=ids[None]).logits[0]
        return model(
            input_ids=ids[None],
            pixel_values=self.pixel_values,
            image_grid_thw=self.grid_thw,
            mm_token_type_ids=(ids == IMAGE).int()[None],
        ).logits[0]


def make_sample(g: torch.Generator, text_lengths: list[int], grids: list[tuple[int, int, int]]) -> Sample:
    ids = [torch.randint(*TEXT_IDS, (text_lengths[0],), generator=g)]
    for (t, h, w), after in zip(grids, text_lengths[1:]):
        image = torch.tensor([START] + [IMAGE] * (t * h * w // 4) + [END])
        ids += [image, torch.randint(*TEXT_IDS, (after,), generator=g)]
    n_patches = sum(t * h * w for t, h, w in grids)
    grid_thw = torch.tensor(grids, dtype=torch.long).reshape(-1, 3)
    return Sample(torch.cat(ids), torch.randn(n_patches, PATCH_DIM, generator=g), grid_thw)


@pytest.fixture(scope="module")
def samples() -> list[Sample]:
    g = torch.Generator().manual_seed(1)
    return [make_sample(g, texts, grids) for texts, grids in LAYOUTS]


def encode(model: torch.nn.Module, sample: Sample) -> SampleImages:
    """What the vision stage would send: the sample's image features, concatenated in token order."""
    if not len(sample.grid_thw):
        return SampleImages(torch.zeros(0, image_feature_width(model.config)), sample.grid_thw)
    return SampleImages(torch.cat(encode_images(model, sample.pixel_values, sample.grid_thw)), sample.grid_thw)


def test_encode_images_equals_model_image_features(vlm, samples):
    sample = samples[1]
    features = encode_images(vlm, sample.pixel_values, sample.grid_thw)
    tower_only = encode_images(vision_tower(vlm), sample.pixel_values, sample.grid_thw)
    with torch.no_grad():
        output = vlm.get_image_features(sample.pixel_values, sample.grid_thw)
    # per image: the merged features, then Qwen3-VL's deepstack features (one per level) beside them
    deepstack = getattr(output, "deepstack_features", None) or []
    expected = [torch.cat(per_image, dim=-1) for per_image in zip(output.pooler_output, *deepstack)]
    assert len(deepstack) == (2 if "Qwen3" in type(vlm).__name__ else 0)
    assert [f.shape for f in features] == [(6, image_feature_width(vlm.config)), (8, image_feature_width(vlm.config))]
    assert not features[0].requires_grad
    for got, tower, want in zip(features, tower_only, expected):
        assert torch.equal(got, want) and torch.equal(tower, want)
    assert is_vision_language_model(vlm) and not is_vision_language_model(vision_tower(vlm))


def test_mrope_positions_equal_get_rope_index(vlm, samples):
    g = torch.Generator().manual_seed(2)
    for sample in samples:
        if not len(sample.grid_thw):
            assert torch.equal(mrope_positions(sample.input_ids, sample.grid_thw, vlm.config),
                               torch.arange(sample.input_ids.numel()).expand(3, -1))
            continue
        # prompt + a text response, as later stages see it
        ids = torch.cat([sample.input_ids, torch.randint(*TEXT_IDS, (5,), generator=g)])
        expected, _ = vlm.model.get_rope_index(ids[None], (ids == IMAGE).int()[None], image_grid_thw=sample.grid_thw)
        assert torch.equal(mrope_positions(ids, sample.grid_thw, vlm.config), expected[:, 0])


def test_samples_of_one_prompt_reuse_its_image_positions_and_never_share_a_result(vlm, samples):
    """The part up to the last image is cached by prompt: each response still gets get_rope_index's
    positions, and writing into one result changes no later one."""
    sample = next(s for s in samples if len(s.grid_thw))
    g = torch.Generator().manual_seed(3)
    for length in (0, 3, 7, 3):
        ids = torch.cat([sample.input_ids, torch.randint(*TEXT_IDS, (length,), generator=g)])
        expected, _ = vlm.model.get_rope_index(ids[None], (ids == IMAGE).int()[None], image_grid_thw=sample.grid_thw)
        got = mrope_positions(ids, sample.grid_thw, vlm.config)
        assert torch.equal(got, expected[:, 0])
        got.fill_(-1)


def test_mismatched_images_name_the_counts(vlm, samples):
    sample = samples[0]  # one image of 4 tokens
    with pytest.raises(ValueError, match=r"4 image tokens in its run but grid_thw \[1, 4, 6\]"):
        mrope_positions(sample.input_ids, torch.tensor([[1, 4, 6]]), vlm.config)
    with pytest.raises(ValueError, match="1 runs of image tokens in the sequence but grid_thw holds 2 images"):
        mrope_positions(sample.input_ids, torch.tensor([[1, 4, 4], [1, 4, 4]]), vlm.config)
    images = encode(vlm, sample)
    short = SampleImages(images.features[:3], images.grid_thw)
    with pytest.raises(ValueError,
                       match=r"sequence 0: 4 image tokens, grid_thw \[\[1, 4, 4\]\] gives 4, features hold 3"):
        packed_forward(vlm, [sample.input_ids], images=[short])
    with pytest.raises(ValueError, match="4 image tokens but 3 image feature rows"):
        embed_with_images(vlm, sample.input_ids, images.features[:3])


@pytest.mark.parametrize("capacity", [None, 48])
def test_packed_logits_equal_full_model(vlm, samples, capacity):
    images = [encode(vlm, s) for s in samples]
    sequences = [s.input_ids for s in samples]
    if capacity is not None:  # several sequences per row, image sequences not only at row starts
        assert len({row for row, _, _ in spans(pack(sequences, capacity))}) < len(sequences)
    with torch.no_grad():
        packed = packed_forward(vlm, sequences, capacity=capacity, images=images)
        for sample, logits in zip(samples, packed):
            torch.testing.assert_close(logits, sample.full_logits(vlm), atol=ATOL, rtol=0)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sequence_logprobs_equal_full_model(vlm, samples, temperature):
    images = [encode(vlm, s) for s in samples]
    with torch.no_grad():
        logp, entropy = sequence_logprobs(
            vlm, [s.input_ids for s in samples], temperature, with_entropy=True, capacity=48, images=images
        )
        for sample, lp, ent in zip(samples, logp, entropy):
            full = torch.log_softmax(sample.full_logits(vlm)[:-1] / temperature, dim=-1)  # (L - 1, V)
            expected = full.gather(-1, sample.input_ids[1:, None]).squeeze(-1)
            torch.testing.assert_close(lp, expected, atol=ATOL, rtol=0)
            torch.testing.assert_close(ent, -(full.exp() * full).sum(-1), atol=ATOL, rtol=0)


@pytest.mark.parametrize("kind", KINDS)
def test_gradients_reach_language_model_only(kind, samples):
    model = build_model(kind)
    images = [encode(model, s) for s in samples]
    logp, _ = sequence_logprobs(model, [s.input_ids for s in samples], 0.7, capacity=48, images=images)
    torch.stack([lp.sum() for lp in logp]).sum().backward()
    language = dict(model.model.language_model.named_parameters())
    packed_grads = {name: p.grad.clone() for name, p in language.items()}
    assert all(p.grad is None for p in model.model.visual.parameters())
    assert all(g.abs().sum() > 0 for g in packed_grads.values())

    # the same loss through the full model from pixels, its vision tower frozen
    model.zero_grad()
    model.model.visual.requires_grad_(False)
    total = 0.0
    for sample in samples:
        full = torch.log_softmax(sample.full_logits(model)[:-1] / 0.7, dim=-1)
        total = total + full.gather(-1, sample.input_ids[1:, None]).sum()
    total.backward()
    for name, p in language.items():
        torch.testing.assert_close(packed_grads[name], p.grad, atol=1e-4, rtol=1e-4, msg=name)


@pytest.fixture(scope="module")
def prompts() -> list[Sample]:
    g = torch.Generator().manual_seed(3)
    return [make_sample(g, [2, 3], [(1, 4, 4)]), make_sample(g, [5, 1, 2], [(1, 4, 6), (1, 8, 4)]),
            make_sample(g, [1, 1], [(1, 6, 6)])]


def test_generate_greedy_equals_full_model_argmax(vlm, prompts):
    images = [encode(vlm, p) for p in prompts]
    assert len({p.input_ids.numel() for p in prompts}) == len(prompts)  # left padding differs per row
    gen = generate(vlm, [p.input_ids for p in prompts], SamplingParams(temperature=0, max_new_tokens=6), images=images)
    with torch.no_grad():
        for prompt, response in zip(prompts, gen.response_ids):
            ids = prompt.input_ids
            for _ in range(6):
                logits = prompt.full_logits(vlm, ids)[-1]
                logits[IMAGE] = -torch.inf  # generate never samples the image token
                ids = torch.cat([ids, logits.argmax()[None]])
            assert torch.equal(response, ids[prompt.input_ids.numel() :])


def test_generate_behaviour_logp_equals_sequence_logprobs(vlm, prompts):
    images = [encode(vlm, p) for p in prompts]
    params = SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=8)
    gen = generate(vlm, [p.input_ids for p in prompts], params, torch.Generator().manual_seed(0), images=images)
    assert all(not (r == IMAGE).any() for r in gen.response_ids)
    full = [torch.cat([p.input_ids, r]) for p, r in zip(prompts, gen.response_ids)]
    with torch.no_grad():
        recomputed, _ = sequence_logprobs(vlm, full, temperature=0.7, images=images)
    for prompt, logp, again in zip(prompts, gen.response_logp, recomputed):
        torch.testing.assert_close(logp, again[prompt.input_ids.numel() - 1 :], atol=ATOL_GENERATE, rtol=0)


def test_generate_with_decode_attention_samples_what_sdpa_samples(vlm, prompts):
    """The rollout stage's attention (backends/decode_attention.py) on M-RoPE models."""
    images = [encode(vlm, p) for p in prompts]
    decoding = copy.deepcopy(vlm)
    use_decode_attention(decoding)
    params = SamplingParams(temperature=1.0, max_new_tokens=8)
    ours, theirs = (generate(model, [p.input_ids for p in prompts], params, torch.Generator().manual_seed(4),
                             images=images) for model in (decoding, vlm))
    assert [r.tolist() for r in ours.response_ids] == [r.tolist() for r in theirs.response_ids]
    for a, b in zip(ours.response_logp, theirs.response_logp):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind", KINDS)
def test_vision_language_critic(kind, samples, tmp_path):
    model = build_model(kind).eval()
    model.save_pretrained(tmp_path / "ckpt")
    critic = load_critic(tmp_path / "ckpt").eval()
    assert isinstance(critic, VisionLanguageCritic) and is_vision_language_model(critic)
    assert not any("visual" in name for name in critic.state_dict())
    tower = load_vision_tower(tmp_path / "ckpt")
    images = [encode(tower if len(s.grid_thw) else model, s) for s in samples]  # the tower alone has no LM width
    for got, want in zip(images, [encode(model, s) for s in samples]):
        assert torch.equal(got.features, want.features)
    sequences = [s.input_ids for s in samples]
    with torch.no_grad():
        assert all((v == 0).all() for v in packed_forward(critic, sequences, capacity=48, images=images))

        # a trainer's critic: a trained head and a changed language model, published through the store
        trainer = load_critic(tmp_path / "ckpt")
        torch.nn.init.normal_(trainer.score.weight, std=0.02, generator=torch.Generator().manual_seed(4))
        trainer.language_model.layers[0].mlp.down_proj.weight.mul_(1.5)
        trained = packed_forward(trainer, sequences, capacity=48, images=images)
        for sample, sample_images, values in zip(samples, images, trained):
            # unpacked: one sequence alone, and the full VLM's hidden states from pixels through the same head
            alone = trainer(
                **language_model_inputs(trainer, sample.input_ids[None], sample_images.features),
                position_ids=mrope_positions(sample.input_ids, sample.grid_thw, trainer.config)[:, None],
            ).logits[0]
            assert values.shape == (sample.input_ids.numel(), 1)
            torch.testing.assert_close(values, alone, atol=ATOL, rtol=0)
        model.model.language_model.load_state_dict(trainer.language_model.state_dict())
        hidden = model.model(
            input_ids=samples[1].input_ids[None], pixel_values=samples[1].pixel_values,
            image_grid_thw=samples[1].grid_thw, mm_token_type_ids=(samples[1].input_ids == IMAGE).int()[None],
        ).last_hidden_state[0]
        torch.testing.assert_close(trained[1], trainer.score(hidden), atol=ATOL, rtol=0)

        store = WeightStore(tmp_path / "weights", "critic")
        store.publish(trainer, version=1)
        assert store.refresh(critic, 0) == 1
        for values, again in zip(trained, packed_forward(critic, sequences, capacity=48, images=images)):
            assert values.abs().max() > 0
            torch.testing.assert_close(again, values, atol=0, rtol=0)
