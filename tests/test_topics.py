"""The topic schemas: what a good handle carries passes, and each way to get it wrong is named."""

from __future__ import annotations

import pytest
import torch

from stream_rlhf.samples import Rollout, ragged
from stream_rlhf.stages.topics import TOPICS, TopicSchemaError, topic_output


def _rollout() -> dict[str, torch.Tensor]:
    return Rollout(
        sequences=[torch.tensor([1, 5, 6, 2]), torch.tensor([1, 7, 2])],
        prompt_lens=torch.tensor([2, 2], dtype=torch.int32),
        behavior_logp=[torch.tensor([-0.1, -0.2]), torch.tensor([-0.3])],
        group_ids=torch.tensor([0, 0]),
    ).to_tensors()


def test_the_outputs_the_stages_build_match_their_schemas():
    out = topic_output("rollout", _rollout(), 2, policy_version=3)
    assert out.topic == "rollout" and out.num_samples == 2 and out.policy_version == 3
    topic_output("reward", {"scores": torch.tensor([1.0, 0.0])}, 2)
    topic_output("ref_logp", ragged("ref_logp", [torch.zeros(2), torch.zeros(1)]), 2)
    topic_output("prompts", {**ragged("prompt_ids", [torch.tensor([1, 5])] * 2), "group_ids": torch.tensor([4, 4])}, 2)
    assert set(TOPICS) == {"prompts", "vision", "rollout", "ref_logp", "old_logp", "values", "reward"}


@pytest.mark.parametrize(("change", "message"), [
    (lambda t: t.pop("behavior_logp"), "topic 'rollout': field 'behavior_logp' is missing"),
    (lambda t: t.update(logp=torch.zeros(3)), r"topic 'rollout': fields \['logp'\] are not in its schema"),
    (lambda t: t.update(sequences=t["sequences"].int()), "field 'sequences': dtype torch.int32, expected torch.int64"),
    (lambda t: t.update(prompt_lens=torch.tensor([2], dtype=torch.int32)),
     r"field 'prompt_lens': shape \(1,\), expected \(2, ...\)"),
    (lambda t: t.update(behavior_logp_lens=torch.tensor([2, 2], dtype=torch.int32)),
     r"field 'behavior_logp': \(3,\) values for lengths summing to 4"),
    (lambda t: t.update(sequences_lens=torch.tensor([4, 3])),
     "field 'sequences'_lens: torch.int64 \\(2,\\), expected int32"),
    (lambda t: t.update(group_ids=[0, 0]), "field 'group_ids': a list, not a tensor"),
    (lambda t: t.update(ragged("loss_mask", [torch.ones(2), torch.ones(1)])),  # an episode's mask is bool
     "field 'loss_mask': dtype torch.float32, expected torch.bool"),
    (lambda t: t.update(ragged("env_rewards", [torch.zeros(2)])), r"field 'env_rewards'_lens: torch.int32 \(1,\)"),
])
def test_a_bad_output_fails_at_publish_naming_topic_and_field(change, message):
    tensors = _rollout()
    change(tensors)
    with pytest.raises(TopicSchemaError, match=message):
        topic_output("rollout", tensors, 2)


def test_an_episode_handle_carries_its_masks_rewards_and_versions():
    tensors = {**_rollout(), **ragged("loss_mask", [torch.tensor([True, False]), torch.tensor([True])]),
               **ragged("env_rewards", [torch.tensor([0.0, 0.0]), torch.tensor([1.0])]),
               **ragged("token_versions", [torch.tensor([3, -1]).int(), torch.tensor([4]).int()])}
    topic_output("rollout", tensors, 2)


def test_an_unknown_topic_is_named():
    with pytest.raises(TopicSchemaError, match="topic 'rollouts': no schema"):
        topic_output("rollouts", {}, 0)
