"""Vision-language models (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) fed precomputed image features instead of pixels.

    tower = load_vision_tower(path)                              # vision stage: the frozen ViT only
    feats = encode_images(tower, pixel_values, grid_thw)         # one (tokens_i, W) per image
    images = SampleImages(torch.cat(feats), grid_thw)            # one per sequence, wire-friendly
    logits = packed_forward(policy, sequences, images=[images])  # every other stage (packing.py)

The vision tower is frozen during RL, so it runs once per image in its own stage; the language
model only needs the merger's output ("image features"), which the full model would scatter over
the `<|image_pad|>` tokens, and the M-RoPE position ids, which depend only on the token ids and the
image grids. With both, the language model gives exactly what the full model gives from pixels.

Glossary:
    image tokens    the `config.image_token_id` tokens of a sequence; one image is one contiguous
                    run of them (Qwen processors wrap each in `<|vision_start|>` ... `<|vision_end|>`),
                    t * (h / merge) * (w / merge) tokens for grid_thw (t, h, w) in patches.
    image features  the vision tower's merged output: one row per image token, of width W = H (the
                    LM's hidden size) or, for Qwen3-VL, H * (1 + D): the merged output followed by
                    the D deepstack features that are added to the hidden states after decoder
                    layers 0..D-1 at the image tokens (the layout vLLM's Qwen3-VL takes as image
                    embeddings). `language_model_inputs` splits them again.
    M-RoPE          Qwen2-VL's rotary positions (3, L): (time, height, width) per token; text tokens
                    use the same value thrice, image tokens their grid coordinates.
"""

from __future__ import annotations

import functools
import itertools
from pathlib import Path

import torch
from torch import Tensor, nn
from transformers import AutoModelForImageTextToText, PretrainedConfig
from transformers.modeling_outputs import TokenClassifierOutput

from stream_rlhf.device_copy import to_device
from stream_rlhf.samples import SampleImages


def is_vision_language_model(model: nn.Module) -> bool:
    """True for a model whose config has a vision tower: the full VLM or `VisionLanguageCritic`."""
    return getattr(getattr(model, "config", None), "vision_config", None) is not None


def vision_tower(model: nn.Module) -> nn.Module:
    """The vision tower of a full VLM (`*ForConditionalGeneration`), of its base model, or itself."""
    for candidate in (getattr(getattr(model, "model", None), "visual", None), getattr(model, "visual", None), model):
        if candidate is not None and hasattr(candidate, "merger") and hasattr(candidate, "spatial_merge_size"):
            return candidate
    raise TypeError(f"{type(model).__name__}: neither a Qwen2-VL-style model nor its vision tower")


def load_vision_tower(path: str | Path) -> nn.Module:
    """The frozen vision tower of a VLM checkpoint (eval mode, no grad); the rest is dropped after
    loading (the whole model is built once, so checkpoint key conversions apply as usual)."""
    model = AutoModelForImageTextToText.from_pretrained(str(path), dtype=torch.float32)
    return vision_tower(model).eval().requires_grad_(False)


def deepstack_levels(config: PretrainedConfig) -> int:
    """D: the deepstack features a VLM's vision tower hands the language model (0 before Qwen3-VL)."""
    return len(getattr(config.vision_config, "deepstack_visual_indexes", None) or ())


def image_feature_width(config: PretrainedConfig) -> int:
    """W: the width of a VLM's image feature rows, H * (1 + D) (see the glossary)."""
    return config.get_text_config().hidden_size * (1 + deepstack_levels(config))


@torch.no_grad()
def encode_images(model: nn.Module, pixel_values: Tensor, grid_thw: Tensor) -> list[Tensor]:
    """Image features, one (tokens_i, W) tensor per image, on the tower's device; no grad.

    `model` is a full VLM or just its vision tower (`load_vision_tower`); `pixel_values` are the
    processor's flattened patches (sum_i t_i * h_i * w_i, C * temporal_patch * patch**2) and
    `grid_thw` (n_images, 3) their grids, as given to the full model. No images: [].
    """
    if len(grid_thw) == 0:
        return []
    tower = vision_tower(model)
    device = next(tower.parameters()).device
    grid_thw = grid_thw.to(device=device, dtype=torch.long)
    merged = tower(pixel_values.to(device=device, dtype=next(tower.parameters()).dtype), grid_thw=grid_thw)
    features = torch.cat([merged.pooler_output, *(getattr(merged, "deepstack_features", None) or [])], dim=-1)
    sizes = (grid_thw.prod(-1) // tower.spatial_merge_size**2).tolist()
    return list(torch.split(features, sizes))  # each (tokens_i, W)


def image_token_count(grid_thw: Tensor, config: PretrainedConfig) -> list[int]:
    """Image tokens of each image: t * (h / merge) * (w / merge) for each (t, h, w) row."""
    merge = config.vision_config.spatial_merge_size
    return [t * (h // merge) * (w // merge) for t, h, w in grid_thw.tolist()]


def mrope_positions(input_ids: Tensor, grid_thw: Tensor, config: PretrainedConfig) -> Tensor:
    """M-RoPE position ids (3, L) long of one sequence (L,), as `model.model.get_rope_index` gives.

    Text tokens count up from the previous token's position + 1 on all three axes; an image's run
    of tokens at start position s gets (s + t, s + row, s + column) over its merged grid, and the
    text after it continues from s + max(h, w) / merge (= the image's max + 1). Tokens after the
    last image (a response) are text. `config` is the VLM's config.

    The part up to the last image token is cached by its tokens and grids (the samples of a prompt,
    and each forward and epoch over them, share it: ~80 us of small tensor operations a sequence,
    on the host of every vision-language forward); the text after it is one `arange`.
    """
    head, current, text = mrope_head(input_ids, grid_thw, config)
    tail = torch.arange(current, current + text).expand(3, -1)
    return torch.cat([head, tail], dim=1).to(input_ids.device)  # (3, L)


def mrope_head(input_ids: Tensor, grid_thw: Tensor, config: PretrainedConfig) -> tuple[Tensor, int, int]:
    """`mrope_positions` in parts, no tensor operation but a cache miss's: the positions (3, E) of
    the tokens up to the last image token (cached and shared: not to be written to), the position
    the text after them starts at, and its number of tokens (L - E)."""
    ids = input_ids.tolist()
    end = len(ids) - ids[::-1].index(config.image_token_id) if config.image_token_id in ids else 0
    head, current = _image_part(tuple(ids[:end]), tuple(map(tuple, grid_thw.tolist())), config.image_token_id,
                                config.vision_config.spatial_merge_size)
    return head, current, len(ids) - end


@functools.lru_cache(maxsize=4096)
def _image_part(ids: tuple[int, ...], grids: tuple[tuple[int, int, int], ...], image_token_id: int,
                merge: int) -> tuple[Tensor, int]:
    """`mrope_positions` of tokens that end with an image's last token (3, len(ids)) and the
    position the text after them starts at. Shared by its callers: not to be written to."""
    is_image = torch.tensor(ids, dtype=torch.long) == image_token_id
    cuts = ((is_image[1:] != is_image[:-1]).nonzero().squeeze(-1) + 1).tolist()
    bounds = [0, *cuts, len(ids)] if ids else [0]
    pieces: list[Tensor] = [torch.zeros(3, 0, dtype=torch.long)]
    current, image = 0, 0
    for start, end in itertools.pairwise(bounds):
        length = end - start
        if not is_image[start]:
            pieces.append(torch.arange(current, current + length).expand(3, -1))
            current += length
            continue
        if image == len(grids):
            raise ValueError(f"image run {image + 1} of the sequence has no grid: grid_thw holds {len(grids)} images")
        t, h, w = grids[image][0], grids[image][1] // merge, grids[image][2] // merge
        if length != t * h * w:
            raise ValueError(
                f"image {image}: {length} image tokens in its run but grid_thw {list(grids[image])} with merge {merge} "
                f"gives {t}*{h}*{w}={t * h * w}"
            )
        grid = torch.stack(torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij"))
        pieces.append(grid.reshape(3, -1) + current)  # (3, t*h*w)
        current += max(h, w)
        image += 1
    if image != len(grids):
        raise ValueError(f"{image} runs of image tokens in the sequence but grid_thw holds {len(grids)} images")
    return torch.cat(pieces, dim=1), current


def scatter_image_features(inputs_embeds: Tensor, input_ids: Tensor, features: Tensor, image_token_id: int) -> Tensor:
    """inputs_embeds (..., L, H) with its image-token rows replaced by `features` (N, H) in
    row-major order of the image tokens of input_ids (..., L); out of place, features detached. The
    tokens are counted where input_ids are (on the host for a train step: no wait for the device)."""
    mask = input_ids == image_token_id  # (..., L)
    n_tokens = int(mask.sum())
    if n_tokens != features.shape[0]:
        raise ValueError(f"{n_tokens} image tokens but {features.shape[0]} image feature rows")
    features = features.detach().to(device=inputs_embeds.device, dtype=inputs_embeds.dtype)
    return inputs_embeds.masked_scatter(to_device(mask, inputs_embeds.device)[..., None], features)


def check_sample_images(index: int, sequence: Tensor, images: SampleImages, config: PretrainedConfig) -> None:
    """Raise naming the counts when a sequence's image tokens, grids and feature rows disagree."""
    n_tokens = int((sequence == config.image_token_id).sum())
    n_grid = sum(image_token_count(images.grid_thw, config))
    if not n_tokens == n_grid == images.features.shape[0]:
        raise ValueError(
            f"sequence {index}: {n_tokens} image tokens, grid_thw {images.grid_thw.tolist()} gives {n_grid}, "
            f"features hold {images.features.shape[0]} rows: all three must be equal"
        )


def check_images(sequences: list[Tensor], images: list[SampleImages], config: PretrainedConfig) -> None:
    """`check_sample_images` of every sequence in a few tensor operations (the counts of all of them
    at once); the first disagreeing one raises its message."""
    tokens = torch.cat(sequences).cpu() == config.image_token_id
    token_sample = torch.repeat_interleave(torch.arange(len(sequences)), torch.tensor([len(s) for s in sequences]))
    n_tokens = torch.zeros(len(sequences), dtype=torch.long).index_add_(0, token_sample, tokens.long())
    per_image = torch.tensor(image_token_count(torch.cat([sample.grid_thw for sample in images]), config),
                             dtype=torch.long)
    image_sample = torch.repeat_interleave(torch.arange(len(images)), torch.tensor([len(s.grid_thw) for s in images]))
    n_grid = torch.zeros(len(images), dtype=torch.long).index_add_(0, image_sample, per_image)
    n_rows = torch.tensor([sample.features.shape[0] for sample in images])
    bad = ((n_tokens != n_grid) | (n_grid != n_rows)).nonzero()
    if len(bad):
        index = int(bad[0])
        check_sample_images(index, sequences[index], images[index], config)


def embed_with_images(model: nn.Module, input_ids: Tensor, features: Tensor) -> Tensor:
    """The model's token embeddings (..., L, H) of input_ids with `features` (N, H) at its image tokens."""
    embed = model.get_input_embeddings()
    embeds = embed(to_device(input_ids, embed.weight.device))
    return scatter_image_features(embeds, input_ids, features, model.config.image_token_id)


def language_model_inputs(model: nn.Module, input_ids: Tensor, features: Tensor) -> dict[str, Tensor | list[Tensor]]:
    """What a VLM's language model takes besides positions and mask, for input_ids (..., L) and
    image features (N, W): `inputs_embeds` (..., L, H) with the merged features at the image
    tokens, and for Qwen3-VL `visual_pos_masks` (..., L) and `deepstack_visual_embeds` (D of (N, H))."""
    levels, width = deepstack_levels(model.config), image_feature_width(model.config)
    if len(features) == 0:  # text prompts only: their stage may not know the width
        features = features.new_zeros((0, width))
    elif features.shape[-1] != width:
        raise ValueError(f"image features of width {features.shape[-1]}: the model takes {width} "
                         f"(hidden size x (1 + {levels} deepstack levels))")
    merged, *deepstack = features.chunk(1 + levels, dim=-1)  # each (N, H)
    inputs: dict[str, Tensor | list[Tensor]] = {"inputs_embeds": embed_with_images(model, input_ids, merged)}
    if levels:
        device = inputs["inputs_embeds"].device
        inputs["visual_pos_masks"] = to_device(input_ids == model.config.image_token_id, device)
        inputs["deepstack_visual_embeds"] = [f.detach().to(device) for f in deepstack]
    return inputs


def decoder_logits(model: nn.Module, **inputs: object) -> Tensor:
    """A VLM's logits through its language model and LM head: Qwen3-VL's own forward takes no
    precomputed deepstack features, its language model does."""
    return model.get_output_embeddings()(model.get_decoder()(**inputs).last_hidden_state)


class VisionLanguageCritic(nn.Module):
    """A VLM checkpoint's language model with a scalar head per token: the critic of a VLM policy.

    Takes `input_ids` or `inputs_embeds` (image features already scattered in; Qwen3-VL's deepstack
    features beside them) with M-RoPE position ids (3, B, L) and returns `.logits` (B, L, 1), like
    AutoModelForTokenClassification does for a text checkpoint. `config` is the VLM's (image token,
    merge size for M-RoPE).
    """

    def __init__(self, config: PretrainedConfig, language_model: nn.Module):
        super().__init__()
        self.config = config
        self.language_model = language_model
        self.score = nn.Linear(
            config.text_config.hidden_size, 1, dtype=language_model.get_input_embeddings().weight.dtype
        )
        nn.init.zeros_(self.score.weight)
        nn.init.zeros_(self.score.bias)

    def get_input_embeddings(self) -> nn.Module:
        return self.language_model.get_input_embeddings()

    def forward(
        self,
        input_ids: Tensor | None = None,
        inputs_embeds: Tensor | None = None,
        position_ids: Tensor | None = None,
        attention_mask: Tensor | None = None,
        **deepstack: Tensor | list[Tensor],
    ) -> TokenClassifierOutput:
        """`deepstack`: Qwen3-VL's `visual_pos_masks` and `deepstack_visual_embeds`
        (`language_model_inputs`)."""
        hidden = self.language_model(
            input_ids=input_ids,
            inputs_embeds=inputs_embeds,
            position_ids=position_ids,
            attention_mask=attention_mask,
            use_cache=False,
            **deepstack,
        ).last_hidden_state  # (B, L, H)
        return TokenClassifierOutput(logits=self.score(hidden))  # (B, L, 1)


def load_vision_language_critic(path: str | Path) -> VisionLanguageCritic:
    """`VisionLanguageCritic` from a VLM checkpoint: its language model, a zero-initialised head."""
    model = AutoModelForImageTextToText.from_pretrained(str(path), dtype=torch.float32)
    return VisionLanguageCritic(model.config, model.model.language_model)
