"""A run's checkpoints on disk: parts written atomically with checksums, the newest complete one
found (a corrupt one skipped with a warning), old ones pruned.

    runs/<name>/checkpoints/
        iter-000010/            the state after 10 training iterations (policy version 10)
            actor/              one part per stateful stage, written by that stage:
                engine.pt           its files
                state.json
                MANIFEST.json       sha256 and size of every file; written last
            critic/
            pruning.json        `keep` and the parts of the last prune (in the newest checkpoint)
        prompt_cursor.jsonl     where the prompt source's dataset stood at each iteration's start

    store = CheckpointStore(run_dir / "checkpoints", keep=2)
    store.write_part(10, "actor", lambda folder: torch.save(snapshot, folder / "engine.pt"))
    point = store.latest(["actor", "critic"])        # newest complete and intact, or None

A part is written into a temporary folder beside its place and renamed there once its manifest
is on disk, so a part either exists whole or not at all. Stages write their parts independently,
each at its own pace; a checkpoint is complete when every part the run needs exists. A part
whose files do not match its manifest (a truncated or corrupt file) makes its checkpoint
unusable: `latest` warns naming the file and falls back to the previous complete one.

A prune records its `keep` and parts in the newest checkpoint's pruning.json, so that a copy of
the folder is pruned as its writers prune theirs (`recorded_store`): the driver's copy of
checkpoints whose parts were written on other hosts, where no one writer's folder has every part.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from stream_rlhf.atomic_file import write_text_atomically

log = logging.getLogger("stream_rlhf")
FOLDER = "checkpoints"
"""A run's checkpoints: `runs/<name>/checkpoints/`."""
MANIFEST = "MANIFEST.json"
PREFIX = "iter-"
PRUNING = "pruning.json"


@dataclass(frozen=True)
class ResumePoint:
    """A complete, verified checkpoint: the state after `version` training iterations."""

    version: int
    folder: Path

    def part(self, name: str) -> Path:
        return self.folder / name


class CheckpointStore:
    def __init__(self, root: str | Path, keep: int = 2):
        self.root = Path(root)
        self.keep = keep

    def folder(self, version: int) -> Path:
        return self.root / f"{PREFIX}{version:06d}"

    def write_part(self, version: int, part: str, write: Callable[[Path], None]) -> Path:
        """Call `write(folder)` to fill a fresh folder, add its manifest and put it in place as
        `part` of checkpoint `version` (replacing an older copy of that part)."""
        final = self.folder(version) / part
        staging = final.parent / f".{part}.{os.getpid()}.tmp"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        write(staging)
        files = {p.name: _digest(p) for p in sorted(staging.iterdir()) if p.is_file()}
        for name in files:
            _fsync(staging / name)
        _write_synced(staging / MANIFEST, json.dumps({"version": version, "part": part, "files": files}, indent=1))
        _fsync(staging)
        if final.exists():
            shutil.rmtree(final)
        os.rename(staging, final)
        _fsync(final.parent)
        return final

    def versions(self, parts: Sequence[str]) -> list[int]:
        """The checkpoints that have every part in `parts`, oldest first (not verified)."""
        return [version for version, folder in _numbered(self.root)
                if all((folder / part / MANIFEST).is_file() for part in parts)]

    def latest(self, parts: Sequence[str]) -> ResumePoint | None:
        """The newest complete checkpoint whose every file matches its manifest; a damaged one is
        skipped with a warning naming the file."""
        for version in reversed(self.versions(parts)):
            folder = self.folder(version)
            damage = next((d for part in parts if (d := _damage(folder / part))), None)
            if damage is None:
                return ResumePoint(version, folder)
            log.warning("checkpoint %s is damaged (%s); trying the one before it", folder, damage)
        return None

    def prune(self, parts: Sequence[str]) -> None:
        """Delete every checkpoint older than the `keep` newest complete ones."""
        self._record_pruning(parts)
        complete = self.versions(parts)
        if len(complete) <= self.keep:
            return
        oldest_kept = complete[-self.keep]
        for version, folder in _numbered(self.root):
            if version < oldest_kept:
                shutil.rmtree(folder, ignore_errors=True)

    def _record_pruning(self, parts: Sequence[str]) -> None:
        """pruning.json in the newest checkpoint folder (written atomically, once)."""
        folders = _numbered(self.root)
        if not folders:
            return
        path = folders[-1][1] / PRUNING
        text = json.dumps({"keep": self.keep, "parts": sorted(parts)})
        if path.is_file() and path.read_text() == text:
            return
        write_text_atomically(path, text)


def recorded_store(root: str | Path) -> tuple[CheckpointStore, list[str]] | None:
    """The store at `root` with the `keep` of its writers' newest recorded prune, and their parts;
    None before any."""
    for _, folder in reversed(_numbered(Path(root))):
        if (folder / PRUNING).is_file():
            record = json.loads((folder / PRUNING).read_text())
            return CheckpointStore(root, record["keep"]), record["parts"]
    return None


def _numbered(root: Path) -> list[tuple[int, Path]]:
    """Every `iter-*` folder in `root` with its version, oldest first."""
    return sorted((int(f.name[len(PREFIX):]), f) for f in root.glob(f"{PREFIX}*") if f.name[len(PREFIX):].isdigit())


def _damage(part: Path) -> str:
    """Why `part` cannot be trusted ("" when every file matches its manifest)."""
    try:
        manifest = json.loads((part / MANIFEST).read_text())
        files = manifest["files"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        return f"{part / MANIFEST}: unreadable ({error})"
    for name, expected in files.items():
        path = part / name
        if not path.is_file():
            return f"{path}: missing"
        if _digest(path) != expected:
            return f"{path}: size or checksum differs from {MANIFEST}"
    return ""


def _digest(path: Path) -> dict[str, object]:
    sha = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            sha.update(chunk)
    return {"bytes": path.stat().st_size, "sha256": sha.hexdigest()}


def _write_synced(path: Path, text: str) -> None:
    with path.open("w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _fsync(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
