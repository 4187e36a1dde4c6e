"""The stages of an RL job and what kind each is: one table that the config checks, the dataflow
compiler and the planner read, in place of lists of names and checks on name suffixes.

    STAGE_KINDS["critic_train"].trains        # True: it holds an optimizer
    STAGE_KINDS["reward_forward"].groupable   # False: one process per instance

The order of the table is the dataflow's (prompts first, the trainers last); the planner lists
stages in it. Which of these stages a given config runs is `driver/dataflow.py`'s business
(`left_out_stages`); the classes are named by dotted path, so reading the table imports no stage.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class StageKind:
    """What one RL stage is."""

    cls: str
    """The stage class, "package.module:Class"."""
    work: Literal["source", "vision", "rollout", "forward", "train"]
    """What its step computes: `source` reads prompts; `vision` runs the frozen vision tower;
    `rollout` generates responses; `forward` scores each sample with one forward pass of a model
    (or a rule), no gradient; `train` takes optimizer steps."""
    groupable: bool
    """It holds a train engine over a copy of the policy's architecture: its instances may be groups
    of ranks (`placement.stages.<stage>.ranks`), use `backend: megatron`, and offload."""
    device_group: bool
    """It may share one process and device with other stages (`placement.device_groups`)."""
    restartable: bool
    """It keeps no state between mini-batches, so the launcher may restart a crashed instance
    (`restarts`); the broker redelivers what the old one had unfinished."""
    critic: bool = False
    """It exists only with a critic (`algorithm.advantage: gae`)."""
    rollout_side: bool = False
    """It runs on `placement.rollout_cores` when separated, always (others may join it there through
    `placement.with_rollout`)."""

    @property
    def trains(self) -> bool:
        return self.work == "train"


STAGE_KINDS: dict[str, StageKind] = {
    "prompts": StageKind("stream_rlhf.stages.prompts:PromptSource", "source", groupable=False,
                         device_group=False, restartable=False, rollout_side=True),
    "vision_prefetch": StageKind("stream_rlhf.stages.vision_prefetch:VisionPrefetch", "vision", groupable=False,
                                 device_group=False, restartable=True),
    "rollout": StageKind("stream_rlhf.stages.rollout:RolloutStage", "rollout", groupable=False,
                         device_group=False, restartable=True, rollout_side=True),
    "ref_forward": StageKind("stream_rlhf.stages.ref_forward:RefForward", "forward", groupable=True,
                             device_group=True, restartable=True),
    "reward_forward": StageKind("stream_rlhf.stages.reward_forward:RewardForward", "forward", groupable=False,
                                device_group=True, restartable=True),
    "actor_forward": StageKind("stream_rlhf.stages.actor_forward:ActorForward", "forward", groupable=True,
                               device_group=True, restartable=True),
    "critic_forward": StageKind("stream_rlhf.stages.critic_forward:CriticForward", "forward", groupable=True,
                                device_group=True, restartable=True, critic=True),
    "actor_train": StageKind("stream_rlhf.stages.actor_train:ActorTrain", "train", groupable=True,
                             device_group=True, restartable=False),
    "critic_train": StageKind("stream_rlhf.stages.critic_train:CriticTrain", "train", groupable=True,
                              device_group=True, restartable=False, critic=True),
    "medusa_train": StageKind("stream_rlhf.stages.medusa_train:MedusaTrain", "train", groupable=False,
                              device_group=False, restartable=False),
}
"""Every stage an RL job may have, in dataflow order."""


def stages_where(test: Literal["groupable", "device_group", "restartable", "critic", "rollout_side", "trains"]
                 ) -> list[str]:
    """The stages whose kind has `test` true, in table order (to name them in an error message)."""
    return [name for name, kind in STAGE_KINDS.items() if getattr(kind, test)]
