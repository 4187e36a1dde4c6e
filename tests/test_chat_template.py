"""Prompts through a chat template: token for token what `tokenizer.apply_chat_template` gives (with
each image pad widened as transformers' Qwen2-VL processor widens it), system prompts, the
end-of-turn and generation_config.json stop tokens and sampling settings, and conversations a
setting cannot encode."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from stream_rlhf.backends.rollout_config import RolloutConfig
from stream_rlhf.config import ConfigError, build
from stream_rlhf.data.chat_template import end_of_turn_id, resolve_chat_template
from stream_rlhf.data.errors import DataError
from stream_rlhf.data.images import ImageSpec
from stream_rlhf.data.prompts_jsonl import PromptDataset
from stream_rlhf.data.tokenizer import stop_token_ids
from stream_rlhf.models.tokenizer import VISION_TOKENS, build_tokenizer
from stream_rlhf.rl.config import RLJobConfig

# Qwen2-VL's chat template (its images part; the default system line lower-cased for the tiny alphabet)
QWEN2_VL_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nyou are a helpful assistant.<|im_end|>\n"
    "{% endif %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}<|im_end|>\n{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'text' or 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}"
    "<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TEXT_ONLY_TEMPLATE = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
                      "{% if message['content'] is string %}{{ message['content'] }}{% endif %}<|im_end|>\n"
                      "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPEC = ImageSpec(patch_size=8, temporal_patch_size=2, merge_size=2, min_pixels=32 * 32, max_pixels=96 * 96,
                 image_mean=(0.5, 0.4, 0.3), image_std=(0.2, 0.3, 0.25))


def _tokenizer():
    tokenizer = build_tokenizer(vision=True)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.add_tokens(["\n"])  # (not in the tiny alphabet)
    return tokenizer


TOKENIZER = _tokenizer()
VISION_IDS = tuple(TOKENIZER.convert_tokens_to_ids(list(VISION_TOKENS)))


def _template_ids(messages: list[dict], template: str = QWEN2_VL_TEMPLATE) -> list[int]:
    out = TOKENIZER.apply_chat_template(messages, chat_template=template, add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)


def _dataset(tmp_path, rows: list[dict], template: str | None = QWEN2_VL_TEMPLATE, **kwargs) -> PromptDataset:
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return PromptDataset(path, TOKENIZER, SPEC, VISION_IDS, "error", 4, 0, template, **kwargs)


def _image(path, width: int, height: int, seed: int) -> None:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(path)


def test_text_conversation_equals_apply_chat_template(tmp_path):
    messages = [{"role": "system", "content": "be brief."}, {"role": "user", "content": "1+2="},
                {"role": "assistant", "content": "3"}, {"role": "user", "content": "and 2+2?"}]
    sample = _dataset(tmp_path, [{"messages": messages, "answer": "4"}]).sample(0)
    expected = _template_ids(messages)
    assert sample.prompt_ids.tolist() == expected and sample.answer == "4" and sample.images == []
    assert TOKENIZER.decode(expected).endswith("<|im_start|>assistant\n")  # the generation prompt is there


def test_image_conversation_equals_template_and_qwen2_vl_processor(tmp_path):
    """Two images (one from the `images` column, one inline): the template's ids with each pad
    widened to the image's tokens, and pixel values equal to transformers' processor's."""
    _image(tmp_path / "a.png", 80, 48, seed=0)
    _image(tmp_path / "b.png", 300, 200, seed=1)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "and"},
                                             {"type": "image", "image": "b.png"}, {"type": "text", "text": "?"}]}]
    sample = _dataset(tmp_path, [{"messages": messages, "images": ["a.png"], "answer": "x"}]).sample(0)
    processor = Qwen2VLImageProcessorPil(patch_size=8, merge_size=2, temporal_patch_size=2, min_pixels=32 * 32,
                                         max_pixels=96 * 96, image_mean=[0.5, 0.4, 0.3], image_std=[0.2, 0.3, 0.25])
    reference = processor(images=[Image.open(tmp_path / "a.png"), Image.open(tmp_path / "b.png")],
                          return_tensors="pt")
    counts = iter((reference["image_grid_thw"].prod(dim=1) // 4).tolist())
    pad = VISION_IDS[1]
    expected = [i for token in _template_ids(messages) for i in ([pad] * next(counts) if token == pad else [token])]
    assert sample.prompt_ids.tolist() == expected
    assert torch.equal(torch.cat([image.pixel_values for image in sample.images]), reference["pixel_values"])
    assert sample.image_paths == (str(tmp_path / "a.png"), str(tmp_path / "b.png"))


def test_todays_form_goes_through_the_template(tmp_path):
    _image(tmp_path / "a.png", 32, 32, seed=0)
    data = _dataset(tmp_path, [{"prompt": "<image>how many?", "images": ["a.png"], "answer": "2"}])
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "how many?"}]}]
    pad = VISION_IDS[1]
    expected = [i for token in _template_ids(messages) for i in ([pad] * 4 if token == pad else [token])]
    assert data.sample(0).prompt_ids.tolist() == expected
    assert data.longest_prompt() == (len(expected), f"{tmp_path / 'train.jsonl'}:1")


def test_system_prompt_from_the_config_unless_the_data_has_one(tmp_path):
    rows = [{"messages": [{"role": "user", "content": "1+1="}], "answer": "2"},
            {"messages": [{"role": "system", "content": "own."}, {"role": "user", "content": "1+1="}], "answer": "2"}]
    data = _dataset(tmp_path, rows, system_prompt="think.")
    added = [{"role": "system", "content": "think."}, {"role": "user", "content": "1+1="}]
    assert data.sample(0).prompt_ids.tolist() == _template_ids(added)
    assert data.sample(1).prompt_ids.tolist() == _template_ids(rows[1]["messages"])


def test_without_a_template_a_conversation_is_one_user_turn(tmp_path):
    one_turn = {"messages": [{"role": "user", "content": "1+1="}], "answer": "2"}
    data = _dataset(tmp_path, [one_turn], template=None)
    assert data.sample(0).prompt_ids.tolist() == [TOKENIZER.bos_token_id, *TOKENIZER.encode("1+1=",
                                                                                             add_special_tokens=False)]
    two_turns = {"messages": [{"role": "system", "content": "x"}, {"role": "user", "content": "y"}], "answer": "2"}
    with pytest.raises(DataError, match=r"train.jsonl:1: a conversation of 2 turn\(s\) \(system, user\) needs a chat "
                                        "template") as error:
        _dataset(tmp_path, [two_turns], template=None)
    assert error.value.kind == "schema"


def test_a_template_that_drops_images_is_a_bad_row(tmp_path):
    _image(tmp_path / "a.png", 32, 32, seed=0)
    row = {"prompt": "<image>how many?", "images": ["a.png"], "answer": "2"}
    with pytest.raises(DataError, match="train.jsonl:1: the chat template wrote 0 image placeholder") as error:
        _dataset(tmp_path, [row], template=TEXT_ONLY_TEMPLATE)
    assert error.value.kind == "image tokens"


def test_resolve_chat_template(tmp_path):
    tokenizer = _tokenizer()
    assert resolve_chat_template("auto", tokenizer) is None  # the tiny tokenizer has none
    assert resolve_chat_template("none", tokenizer) is None
    tokenizer.chat_template = QWEN2_VL_TEMPLATE
    assert resolve_chat_template("auto", tokenizer) == QWEN2_VL_TEMPLATE
    assert resolve_chat_template("none", tokenizer) is None
    (tmp_path / "t.jinja").write_text(TEXT_ONLY_TEMPLATE)
    assert resolve_chat_template(str(tmp_path / "t.jinja"), tokenizer) == TEXT_ONLY_TEMPLATE


def test_stop_tokens_end_of_turn_and_generation_config(tmp_path):
    tokenizer = _tokenizer()
    tokenizer.chat_template = QWEN2_VL_TEMPLATE
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert end_of_turn_id(tokenizer, QWEN2_VL_TEMPLATE) == im_end
    assert end_of_turn_id(tokenizer, None) is None
    eos = tokenizer.eos_token_id
    assert stop_token_ids(tokenizer, None, "none", tmp_path) == (eos,)
    assert stop_token_ids(tokenizer, None, "auto", tmp_path) == (eos, im_end)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [im_end, 7]}))
    assert stop_token_ids(tokenizer, None, "auto", tmp_path) == (eos, im_end, 7)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 9}))
    assert stop_token_ids(tokenizer, None, "none", tmp_path) == (eos, 9)
    assert stop_token_ids(tokenizer, ["<|im_end|>"], "auto", tmp_path) == (im_end,)  # rollout.stop: only those


def test_generation_config_fills_the_unset_sampling_settings(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.7, "top_p": 0.8, "top_k": 20}))
    assert (RolloutConfig().with_generation_defaults(str(tmp_path)).temperature,
            RolloutConfig().with_generation_defaults(str(tmp_path)).top_p) == (0.7, 0.8)
    overridden = RolloutConfig(temperature=1.0).with_generation_defaults(str(tmp_path))
    assert (overridden.temperature, overridden.top_p) == (1.0, 0.8)
    plain = RolloutConfig().with_generation_defaults(None)
    assert (plain.temperature, plain.top_p) == (1.0, 1.0)
    with pytest.raises(ConfigError, match=r"top_p=0.8: backend=vllm needs top_p 1 .*generation_config.json's"):
        RolloutConfig(backend="vllm").with_generation_defaults(str(tmp_path))
    job = build(RLJobConfig, {"name": "x"})
    assert (job.rollout.temperature, job.rollout.top_p) == (1.0, 1.0)  # resolved when the job config is built
