"""What every RL stage is built with: the job config and where its models and weights live."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from stream_rlhf.resume.store import ResumePoint
from stream_rlhf.rl.config import RLJobConfig
from stream_rlhf.rl.reward_parts_config import policy_version_at
from stream_rlhf.stage import StageContext
from stream_rlhf.telemetry.stage_counts import StageCounts


@dataclass(frozen=True)
class JobContext:
    config: RLJobConfig
    checkpoint: str
    """The Hugging Face folder RL starts from (the warm-started tiny model or `model.path`)."""
    weights_root: str
    """Where trainers publish weight versions (`weights.shm_store`)."""
    vision_language: bool = False
    """The checkpoint has a vision tower: prompts carry images (see `stages/images.py`)."""
    resume: ResumePoint | None = None
    """The run checkpoint this run continues from (`resume/store.py`); None: a fresh run."""

    @property
    def start_iteration(self) -> int:
        """The first iteration this run trains: 0, or the iterations the resumed checkpoint holds."""
        return self.resume.version if self.resume is not None else 0

    @property
    def start_version(self) -> int:
        """The policy version the run starts from: the start iteration's, which a critic warm-up
        puts behind it (`policy_version_at`; the warm-up is 0 without a critic)."""
        return policy_version_at(self.start_iteration, self.config.critic.warmup_iterations)

    @property
    def run_dir(self) -> Path:
        return Path(self.config.run_dir)


def stage_counts(job: JobContext, ctx: StageContext) -> StageCounts:
    """The instance's counters for the run summary; only a rank group's leader writes them."""
    return StageCounts(job.run_dir, ctx.stage, ctx.instance_id, write=ctx.group.is_leader)
