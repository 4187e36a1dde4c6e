"""Rollout's outputs kept on disk until a checkpoint covers their iteration, so that a resumed
(or recovered) run trains what the stopped one had generated instead of generating it again.

    store = GeneratedStore(run_dir)
    store.save(output)                     # rollout, before it publishes a mini-batch
    output = store.load(iteration, minibatch)   # rollout of a resumed run: None if never generated
    store.prune(version)                   # once checkpoint `version` is written
    prune_checkpoints(checkpoints, parts, run_dir)  # older checkpoints, and what they covered
    store.samples_from(version)            # the driver, at a resume: samples kept for iterations >= version

One file per mini-batch in `runs/<name>/checkpoints/generated/`, named by iteration, mini-batch
and sample count, written to a temporary name and renamed (a file is whole or absent). It holds
the output as rollout published it: tensors, sample count, the policy version that generated it
and its metadata, so a replayed mini-batch is trained at the staleness it had. For a
vision-language model the image features are not kept: the vision stage encodes the prompt's
images again (the prompts themselves come back from the prompt source's cursor).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import torch

from stream_rlhf.resume.store import FOLDER, CheckpointStore
from stream_rlhf.stage import Output

GENERATED = "generated"
"""The folder of the kept outputs, in the run's checkpoint folder."""
NAME = re.compile(r"(\d+)-(\d+)-(\d+)\.pt")


def prune_checkpoints(checkpoints: CheckpointStore, parts: list[str], run_dir: Path) -> None:
    """Delete the checkpoints older than the `keep` newest complete ones, and rollout's kept
    outputs of the iterations the oldest checkpoint kept covers."""
    checkpoints.prune(parts)
    if kept := checkpoints.versions(parts):
        GeneratedStore(run_dir).prune(kept[0])


class GeneratedStore:
    def __init__(self, run_dir: Path):
        self.folder = Path(run_dir) / FOLDER / GENERATED

    def save(self, output: Output) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / f"{output.iteration:06d}-{output.minibatch:04d}-{output.num_samples}.pt"
        staging = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        torch.save({"topic": output.topic, "tensors": output.tensors, "num_samples": output.num_samples,
                    "policy_version": output.policy_version, "metadata": output.metadata}, staging)
        os.rename(staging, path)

    def load(self, iteration: int, minibatch: int) -> Output | None:
        for path in self.folder.glob(f"{iteration:06d}-{minibatch:04d}-*.pt"):
            saved = torch.load(path, map_location="cpu", weights_only=True)
            return Output(saved["topic"], saved["tensors"], saved["num_samples"], iteration, minibatch,
                          saved["policy_version"], saved["metadata"])
        return None

    def prune(self, version: int) -> None:
        """Forget the mini-batches of iterations before `version` (trained, and checkpointed)."""
        for path, iteration, _ in self._files():
            if iteration < version:
                path.unlink(missing_ok=True)

    def samples_from(self, version: int) -> int:
        return sum(samples for _, iteration, samples in self._files() if iteration >= version)

    def _files(self) -> list[tuple[Path, int, int]]:
        found = []
        for path in self.folder.glob("*.pt") if self.folder.is_dir() else ():
            if match := NAME.fullmatch(path.name):
                found.append((path, int(match[1]), int(match[3])))
        return found
