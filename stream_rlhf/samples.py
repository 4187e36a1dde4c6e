"""How variable-length samples travel in one handle: flat token tensors plus their lengths.

    fields = ragged("behavior_logp", per_sample_logps)       # {"behavior_logp": (sum R_i,), "behavior_logp_lens": (N,)}
    per_sample = unragged(batch.tensors, "behavior_logp")   # [Tensor (R_i,), ...]

No padding crosses the broker: a mini-batch of N sequences is one flat tensor and an (N,) length
tensor per field. `Rollout` is the rollout topic's content that every downstream stage reads;
`SampleImages` the encoded images of one sequence, as engines take them; `pad_right` makes the
(N, L) tensors a model or a loss reads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn


def ragged(name: str, values: list[Tensor]) -> dict[str, Tensor]:
    lens = torch.tensor([len(v) for v in values], dtype=torch.int32)
    flat = torch.cat(values) if values else torch.empty(0)
    return {name: flat, f"{name}_lens": lens}


def unragged(tensors: dict[str, Tensor], name: str) -> list[Tensor]:
    return list(torch.split(tensors[name], tensors[f"{name}_lens"].tolist()))


def pad_right(seqs: list[Tensor], value: float) -> Tensor:
    """Stack (L_i, ...) tensors into (B, Lmax, ...), filling the tail of each with `value`."""
    return nn.utils.rnn.pad_sequence(seqs, batch_first=True, padding_value=value)


@dataclass
class Rollout:
    """One generated mini-batch: N sequences (prompt + response) and what the sampler recorded."""

    sequences: list[Tensor]
    """(P_i + R_i,) token ids."""
    prompt_lens: Tensor
    """(N,) int32."""
    behavior_logp: list[Tensor]
    """(R_i,) log-probs of the response tokens under the policy that sampled them."""
    group_ids: Tensor
    """(N,) int64: samples of the same prompt share a group id (GRPO, RLOO)."""

    @property
    def responses(self) -> list[Tensor]:
        return [s[p:] for s, p in zip(self.sequences, self.prompt_lens.tolist())]

    @property
    def num_tokens(self) -> int:
        return sum(len(s) for s in self.sequences)

    def to_tensors(self) -> dict[str, Tensor]:
        return {
            **ragged("sequences", self.sequences),
            **ragged("behavior_logp", self.behavior_logp),
            "prompt_lens": self.prompt_lens,
            "group_ids": self.group_ids,
        }

    @classmethod
    def from_tensors(cls, tensors: dict[str, Tensor]) -> Rollout:
        return cls(
            unragged(tensors, "sequences"), tensors["prompt_lens"],
            unragged(tensors, "behavior_logp"), tensors["group_ids"],
        )


def response_slices(per_position: list[Tensor], prompt_lens: Tensor) -> list[Tensor]:
    """From per-position predictions of each sequence (L_i - 1, ...) (position t predicts token
    t + 1), keep the ones that predict response tokens: (R_i, ...)."""
    return [v[p - 1:] for v, p in zip(per_position, prompt_lens.tolist())]


@dataclass(frozen=True)
class SampleImages:
    """The images of one sequence, already encoded by the vision tower."""

    features: Tensor
    """(n_tokens, H) float: the features of the sequence's images concatenated in the order of its
    image tokens (n_tokens = its number of image tokens; (0, H) for a sequence without images)."""
    grid_thw: Tensor
    """(n_images, 3) long: (t, h, w) of each image in vision patches, in the same order."""

    def __post_init__(self) -> None:
        if self.features.ndim != 2:
            raise ValueError(f"features.shape={tuple(self.features.shape)}: must be (n_tokens, hidden)")
        if self.grid_thw.ndim != 2 or self.grid_thw.shape[1] != 3:
            raise ValueError(f"grid_thw.shape={tuple(self.grid_thw.shape)}: must be (n_images, 3)")

    def followed_by(self, later: SampleImages) -> SampleImages:
        """These images, then `later`'s (a sequence whose image runs come in that order)."""
        if not len(later.features):
            features = self.features
        elif not len(self.features):  # (0, H) or, from a mini-batch without images, (0, 0)
            features = later.features
        else:
            features = torch.cat([self.features, later.features.to(self.features)])
        return SampleImages(features, torch.cat([self.grid_thw, later.grid_thw.to(self.grid_thw)]))
