"""Qwen3 and Qwen3-VL as the project runs them: the tiny models built from `model.tiny`, a
checkpoint folder (`stream-rlhf init-model`, then `model.path`) loaded by every role, and the
sampler's behaviour log-probs equal to the trainer's recomputation to 1e-5 (fp32), Qwen3-VL's with
its deepstack image features, computed once by the vision tower as the vision stage does.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import Qwen3ForCausalLM, Qwen3ForTokenClassification, Qwen3VLForConditionalGeneration

from stream_rlhf.backends.decode_attention import use_decode_attention
from stream_rlhf.backends.torch_engine import TorchTrainEngine
from stream_rlhf.backends.torch_rollout import SamplingParams, generate
from stream_rlhf.cli import main
from stream_rlhf.config import ConfigError, load_config
from stream_rlhf.distributed import RankGroup
from stream_rlhf.models.checkpoint import build_tiny, load_critic, load_policy
from stream_rlhf.models.model_config import TinyModelConfig, TinyVisionConfig
from stream_rlhf.models.tokenizer import VISION_TOKENS, build_tokenizer
from stream_rlhf.models.vision_language import (
    VisionLanguageCritic,
    encode_images,
    image_feature_width,
    load_vision_tower,
)
from stream_rlhf.rl.config import RLJobConfig
from stream_rlhf.samples import SampleImages
from tests.bench_run import REPO

ATOL = 1e-5
TOKENIZER = build_tokenizer(vision=True)
START, IMAGE, END = TOKENIZER.convert_tokens_to_ids(list(VISION_TOKENS))
GRIDS = [[(1, 4, 4)], [(1, 4, 6), (1, 8, 4)], []]
"""Each prompt's images as (t, h, w) patch grids (merge 2: 4, then 6 + 8, then no image tokens)."""


def init_model(config: str, folder: Path, *sets: str) -> Path:
    """`stream-rlhf init-model` from a shipped config, as a user makes a model folder."""
    assert main(["init-model", str(REPO / "configs" / config), str(folder),
                 *(x for s in sets for x in ("--set", s))]) == 0
    return folder


@pytest.fixture(scope="module")
def qwen3_vl(tmp_path_factory) -> Path:
    return init_model("mllm_ppo.yaml", tmp_path_factory.mktemp("qwen3_vl") / "model", "model.tiny.architecture=qwen3",
                      "model.tiny.vision.depth=3")


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory) -> Path:
    return init_model("text_ppo.yaml", tmp_path_factory.mktemp("qwen3") / "model", "model.tiny.architecture=qwen3")


def test_the_tiny_models_are_qwen3_and_qwen3_vl_with_deepstack(qwen3, qwen3_vl):
    text = build_tiny(TinyModelConfig(architecture="qwen3"), build_tokenizer(), seed=0)
    assert isinstance(text, Qwen3ForCausalLM)
    attention = text.model.layers[0].self_attn
    assert attention.q_proj.bias is None and attention.q_norm.weight.shape == (32,)  # per head, no bias
    vlm = build_tiny(TinyModelConfig(architecture="qwen3", vision=TinyVisionConfig(depth=3)), TOKENIZER, seed=0)
    assert isinstance(vlm, Qwen3VLForConditionalGeneration)
    assert vlm.config.vision_config.deepstack_visual_indexes == [0, 1]
    assert image_feature_width(vlm.config) == 3 * vlm.config.text_config.hidden_size

    config = json.loads((qwen3_vl / "config.json").read_text())
    assert config["architectures"] == ["Qwen3VLForConditionalGeneration"]
    assert config["vision_config"]["deepstack_visual_indexes"] == [0, 1]
    assert (qwen3_vl / "preprocessor_config.json").is_file() and (qwen3_vl / "tokenizer.json").is_file()
    assert json.loads((qwen3 / "config.json").read_text())["architectures"] == ["Qwen3ForCausalLM"]


def test_init_model_refuses_a_folder_that_exists(qwen3, capsys):
    assert main(["init-model", str(REPO / "configs/mllm_ppo.yaml"), str(qwen3)]) == 2
    assert f"init-model {qwen3}: already exists" in capsys.readouterr().err


def test_every_role_loads_the_folders(qwen3, qwen3_vl):
    assert isinstance(load_policy(qwen3), Qwen3ForCausalLM)
    assert isinstance(load_critic(qwen3), Qwen3ForTokenClassification)
    policy = load_policy(qwen3_vl)
    assert isinstance(policy, Qwen3VLForConditionalGeneration)
    critic = load_critic(qwen3_vl)
    assert isinstance(critic, VisionLanguageCritic) and not any("visual" in n for n in critic.state_dict())
    tower = load_vision_tower(qwen3_vl)
    assert len(tower.deepstack_merger_list) == 2
    expected = policy.model.visual.state_dict()
    assert all(torch.equal(t, expected[name]) for name, t in tower.state_dict().items())


def vision_prompts(folder: Path) -> tuple[list[torch.Tensor], list[SampleImages]]:
    """Prompts with image tokens and their features, encoded once by the tower alone (the vision stage)."""
    g = torch.Generator().manual_seed(0)
    tower = load_vision_tower(folder)
    width = image_feature_width(load_policy(folder).config)
    prompts, images = [], []
    for grids in GRIDS:
        ids = [torch.randint(4, START, (3,), generator=g)]
        for t, h, w in grids:
            image = torch.tensor([START] + [IMAGE] * (t * h * w // 4) + [END])
            ids += [image, torch.randint(4, START, (2,), generator=g)]
        grid = torch.tensor(grids, dtype=torch.long).reshape(-1, 3)
        patches = torch.randn(int(grid.prod(-1).sum()), 3 * 2 * 8 * 8, generator=g)
        features = encode_images(tower, patches, grid)
        prompts.append(torch.cat(ids))
        images.append(SampleImages(torch.cat(features) if features else torch.zeros(0, width), grid))
    return prompts, images


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_vl"])
def test_sampler_and_trainer_log_probs_agree(kind, request):
    """The rollout stage's model (decode attention, KV cache, left padding) against the trainer's
    engine (packed forward, fused log-prob kernel), both loaded from the folder."""
    folder = request.getfixturevalue(kind)
    if kind == "qwen3_vl":
        prompts, images = vision_prompts(folder)
    else:
        g = torch.Generator().manual_seed(0)
        prompts, images = [torch.randint(4, 40, (n,), generator=g) for n in (5, 1, 8)], None
    sampler = load_policy(folder).eval()
    use_decode_attention(sampler)
    params = SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=4, pad_token_id=TOKENIZER.pad_token_id)
    gen = generate(sampler, prompts, params, torch.Generator().manual_seed(1), images=images)
    assert [len(r) for r in gen.response_ids] == [4, 4, 4]
    trainer = TorchTrainEngine(load_policy(folder), RankGroup.single())
    sequences = [torch.cat([p, r]) for p, r in zip(prompts, gen.response_ids)]
    recomputed = trainer.forward_logprobs(sequences, 0.7, images=images)
    for prompt, behaviour, again in zip(prompts, gen.response_logp, recomputed):
        torch.testing.assert_close(behaviour, again[len(prompt) - 1:], atol=ATOL, rtol=0)


def test_a_batch_of_text_prompts_runs_through_a_qwen3_vl_without_features_of_its_width(qwen3_vl):
    """A mini-batch without any image hands on features of width 0 (`stages/images.py`)."""
    policy = load_policy(qwen3_vl).eval()
    prompts = [torch.tensor([5, 6, 7]), torch.tensor([8, 9])]
    images = [SampleImages(torch.zeros(0, 0), torch.zeros(0, 3, dtype=torch.long))] * 2
    gen = generate(policy, prompts, SamplingParams(temperature=0, max_new_tokens=3), images=images)
    assert [len(r) for r in gen.response_ids] == [3, 3]
    with pytest.raises(ValueError, match=r"image features of width 5: the model takes 384 \(hidden size x \(1 \+ 2"):
        one = torch.tensor([START, IMAGE, END])
        generate(policy, [one], SamplingParams(max_new_tokens=1),
                 images=[SampleImages(torch.zeros(1, 5), torch.tensor([[1, 2, 2]]))])


def test_megatron_refuses_a_tiny_qwen3_vl_naming_the_reason():
    sets = ["model.tiny.architecture=qwen3", "placement.stages={actor_train: {backend: megatron}}"]
    with pytest.raises(ConfigError, match=r"placement\.stages\.actor_train\.backend=megatron: model\.tiny is "
                                          r"Qwen3-VL, whose deepstack image features"):
        load_config(RLJobConfig, REPO / "configs/mllm_ppo.yaml", sets)
    text = load_config(RLJobConfig, REPO / "configs/text_ppo.yaml", sets)  # Qwen3 text maps
    assert text.placement.of("actor_train").backend == "megatron"
