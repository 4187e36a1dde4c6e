"""Forward-only engines: frozen models a stage asks for numbers, never trains.

    reward = RewardModelEngine(cfg.reward.model_path)
    scores = reward.scores(sequences)                      # (N,) one scalar per sequence
    prm = ProcessRewardEngine(cfg.reward.process.model_path, pad_token_id)
    probs = prm.step_scores(sequences, end_positions)      # per sequence (S_i,): P(step right)
    tower = VisionTowerEngine(checkpoint, device)
    features = tower.image_features(pixel_values, grid)    # per image (tokens_i, H)

Each loads and owns its model and the device it runs on. The reward model and the PRM run on the
CPU in float32, the whole mini-batch at once, right-padded, under `torch.inference_mode`; the
vision tower runs on the stage's device without gradients (`models/vision_language.py`).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from stream_rlhf.models.checkpoint import load_reward_model
from stream_rlhf.models.prm import load_prm
from stream_rlhf.models.vision_language import encode_images, load_vision_tower
from stream_rlhf.samples import pad_right


def _padded(sequences: list[Tensor], pad: int) -> tuple[Tensor, Tensor]:
    """(input_ids, attention_mask), both (N, L) long: the sequences right-padded with `pad`."""
    input_ids = pad_right(sequences, pad).long()  # (N, L)
    lengths = torch.tensor([len(s) for s in sequences])
    mask = (torch.arange(input_ids.shape[1])[None] < lengths[:, None]).long()  # (N, L)
    return input_ids, mask


class RewardModelEngine:
    """A reward model: a sequence-classification checkpoint with one label."""

    def __init__(self, path: str | Path):
        self.model = load_reward_model(path)

    def scores(self, sequences: list[Tensor]) -> Tensor:
        """(N,) float32: the model's scalar for each whole sequence (prompt + response)."""
        pad = self.model.config.pad_token_id if self.model.config.pad_token_id is not None else 0
        input_ids, mask = _padded(sequences, pad)
        with torch.inference_mode():
            logits = self.model(input_ids=input_ids, attention_mask=mask).logits  # (N, 1)
        return logits[:, 0].float()


class ProcessRewardEngine:
    """A process reward model: a token-classification checkpoint with one label, read at the end
    token of each step. It reads the policy's token ids (`pad_token_id`: the policy tokenizer's)."""

    def __init__(self, path: str | Path, pad_token_id: int):
        self.model = load_prm(path)
        self.pad_token_id = pad_token_id

    def step_scores(self, sequences: list[Tensor], end_positions: list[Tensor]) -> list[Tensor]:
        """Per sequence (S_i,): sigmoid(logit) at each of its steps' end positions (indices into the
        sequence), having read the sequence up to there."""
        input_ids, mask = _padded(sequences, self.pad_token_id)
        with torch.inference_mode():
            logits = self.model(input_ids=input_ids, attention_mask=mask).logits[..., 0].float()  # (N, L)
        probs = torch.sigmoid(logits)
        return [probs[i, ends] for i, ends in enumerate(end_positions)]


class VisionTowerEngine:
    """The frozen vision tower of a vision-language checkpoint, on `device`."""

    def __init__(self, checkpoint: str | Path, device: torch.device | str):
        self.model = load_vision_tower(checkpoint).to(device)

    def image_features(self, pixel_values: Tensor, grid_thw: Tensor) -> list[Tensor]:
        """One (tokens_i, H) tensor per image, on the engine's device: the merged features the
        language model reads at the image's tokens. `pixel_values`: the images' patches, image
        after image; `grid_thw` (n_images, 3) their grids. No images: []."""
        return encode_images(self.model, pixel_values, grid_thw)
