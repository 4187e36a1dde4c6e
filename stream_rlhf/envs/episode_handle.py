"""Episodes as the fields of a rollout handle: the one place that turns `Episode` records into the
tensors the downstream stages read (the contract of docs/environments.md).

    tensors = episode_tensors(episodes)      # + group_ids and metadata -> topic_output("rollout", ...)

Per episode i with prompt P_i and R_i response tokens (every token after the prompt: policy
turns and observations):

    sequences       ragged int64   (P_i + R_i,)  prompt + response ids, as sampled / as tokenized
    prompt_lens     (N,) int32     P_i
    behavior_logp   ragged float32 (R_i,)  the sampler's log-probs; 0.0 on observation tokens
    loss_mask       ragged bool    (R_i,)  True on policy tokens, False on observation tokens
    env_rewards     ragged float32 (R_i,)  each turn's reward on its turn's last policy token, 0 elsewhere
    token_versions  ragged int32   (R_i,)  the policy version that sampled each token; -1 on observations

and, only when some observation of the mini-batch had images (a vision-language policy):

    episode_image_features  ragged float32 (T_i, W)  the features of episode i's observation images,
                                                     in token order (T_i image tokens; 0 rows: none)
    episode_image_grid_thw  ragged int64   (n_i, 3)  their grids

which every consumer's `ImageInputs.of` appends to the sample's prompt images (`stages/images.py`).

The forwards see `sequences` as any prompt + response; only the losses tell the tokens apart
(by `loss_mask`), so log-probs, values and KL at observation positions are computed but never used.
"""

from __future__ import annotations

import torch
from torch import Tensor

from stream_rlhf.envs.episode import Episode
from stream_rlhf.samples import ragged


def episode_tensors(episodes: list[Episode]) -> dict[str, Tensor]:
    """The rollout handle's per-sample fields of `episodes` (all but `group_ids`), in their order."""
    responses = [episode.response_tensors() for episode in episodes]
    return {
        **ragged("sequences", [torch.tensor(e.prompt_ids + e.token_ids, dtype=torch.long) for e in episodes]),
        "prompt_lens": torch.tensor([len(e.prompt_ids) for e in episodes], dtype=torch.int32),
        **ragged("behavior_logp", [r["behavior_logp"] for r in responses]),
        **ragged("loss_mask", [r["loss_mask"] for r in responses]),
        **ragged("env_rewards", [r["token_rewards"].float() for r in responses]),
        **ragged("token_versions", [r["policy_versions"].int() for r in responses]),
        **observation_image_fields(episodes),
    }


def observation_image_fields(episodes: list[Episode]) -> dict[str, Tensor]:
    """The `episode_image_*` fields, or {} when no observation had images."""
    seen = [images for episode in episodes for images in episode.observation_images]
    if not seen:
        return {}
    width = seen[0].features.shape[-1]
    features = [torch.cat([im.features.float() for im in e.observation_images]) if e.observation_images
                else torch.zeros((0, width)) for e in episodes]  # each (T_i, W)
    grids = [torch.cat([im.grid_thw.long() for im in e.observation_images]) if e.observation_images
             else torch.zeros((0, 3), dtype=torch.long) for e in episodes]  # each (n_i, 3)
    return {**ragged("episode_image_features", features), **ragged("episode_image_grid_thw", grids)}
