"""What every RL stage is built with: the job config and where its models and weights live."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from stream_rlhf.resume.store import ResumePoint
from stream_rlhf.rl.config import RLJobConfig
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
    def start_version(self) -> int:
        """The policy version the run starts from: 0, or the resumed checkpoint's."""
        return self.resume.version if self.resume is not None else 0

    @property
    def run_dir(self) -> Path:
        return Path(self.config.run_dir)


def stage_counts(job: JobContext, ctx: StageContext) -> StageCounts:
    """The instance's counters for the run summary; only a rank group's leader writes them."""
    return StageCounts(job.run_dir, ctx.stage, ctx.instance_id, write=ctx.group.is_leader)
