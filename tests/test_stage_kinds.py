"""The table of RL stage kinds names real stage classes, and the config checks read it."""

from __future__ import annotations

import pytest

from stream_rlhf.config import ConfigError, build, import_dotted
from stream_rlhf.rl.config import RLJobConfig
from stream_rlhf.rl.stage_kinds import STAGE_KINDS, stages_where
from stream_rlhf.stage import Stage


@pytest.mark.parametrize("name", list(STAGE_KINDS))
def test_each_kind_names_a_stage_class(name):
    cls = import_dotted(STAGE_KINDS[name].cls, f"STAGE_KINDS.{name}")
    assert isinstance(cls, type) and issubclass(cls, Stage)


def test_the_groups_a_config_may_form_follow_the_table(tmp_path):
    assert stages_where("groupable") == ["ref_forward", "actor_forward", "critic_forward", "actor_train",
                                         "critic_train"]
    assert stages_where("trains") == ["actor_train", "critic_train", "medusa_train"]
    base = {"name": "k", "runs_dir": str(tmp_path)}
    for stage in stages_where("groupable"):
        build(RLJobConfig, {**base, "placement": {"stages": {stage: {"ranks": 2}}}})
    with pytest.raises(ConfigError, match="placement.stages.medusa_train.ranks=2: only ref_forward"):
        build(RLJobConfig, {**base, "placement": {"stages": {"medusa_train": {"ranks": 2}}}})
    with pytest.raises(ConfigError, match="restarts.critic_train=1: only vision_prefetch, rollout, ref_forward"):
        build(RLJobConfig, {**base, "restarts": {"critic_train": 1}})
