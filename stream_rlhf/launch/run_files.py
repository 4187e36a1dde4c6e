"""A host's run folder mirrored into the driver's: what ranks on another host write reaches the run
folder the user sees (metrics, stage counts, trace events, samples, checkpoints).

    mirror = FolderMirror(host_run_dir)          # on the ranks' host: scans, remembers what was sent
    changes = mirror.changes(max_bytes=32 << 20) # [] once the driver has everything written so far
    apply_changes(driver_run_dir, changes)       # on the driver: appends, whole files, deletions

    inputs = FolderMirror(driver_run_dir, ["checkpoints/iter-000004/actor"])  # the other way (a resume):
    apply_changes(host_run_dir, inputs.changes()); mirror.remember(path)       # not shipped back

Each scan compares every file with what was sent before: a file that only grew (same inode, and
the last bytes sent are still where they were) sends what was appended (metrics.jsonl, trace
events, samples.jsonl are appended line by line, so the driver's copy stays live); any other change
(a file replaced, as stage counts and checkpoints are, or rewritten in place) sends the whole file
again; a file gone is deleted on the driver too. A file sent whole arrives in a `.shipping` file
first and replaces the driver's copy once complete, so a reader never sees half of it. Large files
travel in chunks of at most `max_bytes` per call; what is left goes in the next call. A file caught
mid-write is sent again once it changes, so the driver's folder is exact after a last `changes`
taken once every writer stopped.

Checkpoints (`resume/store.py`) arrive as they are on the host: a part is written in a hidden
staging folder (`.<part>.<pid>.tmp`), renamed into place with its MANIFEST.json, and old `iter-*`
folders are deleted by the trainer's prune. The mirror skips staging folders (and hidden `.tmp`
files) and sends a folder's MANIFEST.json only in a call where every other file of that folder is
sent to the end (in that call or before), so a part in the driver's folder never has its manifest
before its files (a checkpoint is complete there only when it is complete). A deleted file's
`.shipping` copy goes too, and the folders a deletion empties, so a pruned `iter-*` folder leaves
nothing behind: the driver keeps the checkpoints the trainer's host keeps. The rest of a file
whose `.shipping` copy is gone (its folder pruned on the driver meanwhile) is dropped.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from stream_rlhf.resume.store import MANIFEST

TAIL_BYTES = 4096
"""How much of a file's end is kept to tell an append from a rewrite."""
SHIPPING = ".shipping"


@dataclass(frozen=True)
class FileChange:
    """One piece of a file of the run folder (or its deletion), by path relative to the folder."""

    path: str
    offset: int
    """Where `data` goes in the driver's copy; 0 with `whole`: a new copy of the file."""
    data: bytes
    whole: bool
    """The file is sent whole (into a `.shipping` copy); False: `data` is appended at `offset`."""
    last: bool = True
    """The file is complete with this piece (`whole` only: the copy replaces the driver's file)."""
    deleted: bool = False


@dataclass
class _Sent:
    inode: int
    size: int
    mtime_ns: int
    tail: bytes


class FolderMirror:
    """The sending side: changes of `folder` since the last call (see the module docstring)."""

    def __init__(self, folder: Path | str, paths: list[str] | None = None):
        """`paths`: only these files and folders (relative to `folder`); None: everything in it."""
        self.folder = Path(folder)
        self.paths = None if paths is None else [Path(p) for p in paths]
        self.sent: dict[str, _Sent] = {}
        self._partial: dict[str, tuple[os.stat_result, int]] = {}  # a whole file sent up to an offset

    def remember(self, relative: str) -> None:
        """Count the file `relative` as sent as it is now (it came from the other side)."""
        with (self.folder / relative).open("rb") as f:
            stat = os.fstat(f.fileno())
            self._sent(relative, stat, stat.st_size, f)

    def changes(self, max_bytes: int = 32 << 20) -> list[FileChange]:
        out: list[FileChange] = []
        budget = max_bytes
        present = set()
        unfinished: set[Path] = set()  # folders with a file not all sent yet: their manifest waits
        files = (p.relative_to(self.folder) for p in self._files())
        for relative_path in sorted((r for r in files if not _staging(r)), key=_manifest_last):
            relative = relative_path.as_posix()
            present.add(relative)
            if relative_path.name == MANIFEST and relative_path.parent in unfinished:
                continue
            path = self.folder / relative_path
            try:
                change = self._change(path, relative, budget) if budget > 0 else None
                if not self._unchanged(path, relative):
                    unfinished.add(relative_path.parent)
            except FileNotFoundError:  # replaced or deleted while scanned: the next call sees it
                unfinished.add(relative_path.parent)
                continue
            if change is not None:
                out.append(change)
                budget -= max(len(change.data), 1)
        for relative in sorted((set(self.sent) | set(self._partial)) - present):
            self.sent.pop(relative, None)
            self._partial.pop(relative, None)
            out.append(FileChange(relative, 0, b"", whole=False, deleted=True))
        return out

    def _files(self) -> list[Path]:
        """The files to compare: the folder's, or those of `paths` (a file, or a folder's files)."""
        found = []
        for root in [self.folder] if self.paths is None else [self.folder / p for p in self.paths]:
            found += [root] if root.is_file() else [p for p in root.rglob("*") if p.is_file()]
        return found

    def _unchanged(self, path: Path, relative: str) -> bool:
        """Every byte of the file as it is now was sent."""
        stat, before = path.stat(), self.sent.get(relative)
        return before is not None and (before.inode, before.size, before.mtime_ns) == (stat.st_ino, stat.st_size,
                                                                                      stat.st_mtime_ns)

    def _change(self, path: Path, relative: str, budget: int) -> FileChange | None:
        if self._unchanged(path, relative):
            return None
        stat = path.stat()
        before = self.sent.get(relative)
        with path.open("rb") as f:
            partial = self._partial.get(relative)
            if partial is not None and _same(partial[0], stat):  # the rest of a whole file
                offset = partial[1]
            elif before is not None and before.inode == stat.st_ino and stat.st_size > before.size \
                    and _read_at(f, before.size - len(before.tail), len(before.tail)) == before.tail:
                data = _read_at(f, before.size, min(stat.st_size - before.size, budget))
                self._sent(relative, stat, before.size + len(data), f)
                return FileChange(relative, before.size, data, whole=False)
            else:
                offset = 0
            data = _read_at(f, offset, min(stat.st_size - offset, budget))
            end = offset + len(data)
            if end < stat.st_size:
                self._partial[relative] = (stat, end)
            else:
                self._partial.pop(relative, None)
                self._sent(relative, stat, end, f)
            return FileChange(relative, offset, data, whole=True, last=end >= stat.st_size)

    def _sent(self, relative: str, stat: os.stat_result, size: int, f) -> None:
        tail_from = max(0, size - TAIL_BYTES)
        # a file still growing is taken as far as it was read: the next call sends the rest
        self.sent[relative] = _Sent(stat.st_ino, size, stat.st_mtime_ns if size == stat.st_size else -1,
                                    _read_at(f, tail_from, size - tail_from))


def _staging(relative: Path) -> bool:
    """A hidden `.tmp` file or folder: a write in progress, renamed into place when done."""
    return any(part.startswith(".") and part.endswith(".tmp") for part in relative.parts)


def _manifest_last(relative: Path) -> tuple[tuple[str, ...], bool, str]:
    """Sort key: folder by folder, a folder's manifest after its other files."""
    return relative.parent.parts, relative.name == MANIFEST, relative.name


def _same(a: os.stat_result, b: os.stat_result) -> bool:
    return (a.st_ino, a.st_size, a.st_mtime_ns) == (b.st_ino, b.st_size, b.st_mtime_ns)


def _read_at(f, offset: int, length: int) -> bytes:
    f.seek(offset)
    return f.read(length)


def apply_changes(run_dir: Path | str, changes: list[FileChange]) -> int:
    """Write `changes` into the driver's run folder; returns the bytes written."""
    root = Path(run_dir)
    written = 0
    for change in changes:
        target = root / change.path
        if root.resolve() not in target.resolve().parents:
            raise ValueError(f"run folder {root}: refusing to write {change.path!r} outside it")
        if change.deleted:
            target.unlink(missing_ok=True)
            target.with_name(target.name + SHIPPING).unlink(missing_ok=True)
            _remove_empty(target.parent, root)
            continue
        copy = target.with_name(target.name + SHIPPING)
        if change.whole and change.offset and not copy.exists():  # pruned here meanwhile: the rest goes too
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        if change.whole:
            with copy.open("r+b" if change.offset else "wb") as f:
                f.seek(change.offset)
                f.write(change.data)
            if change.last:
                os.replace(copy, target)
        else:
            with target.open("r+b" if target.exists() else "wb") as f:
                f.seek(change.offset)
                f.write(change.data)
                f.truncate()
        written += len(change.data)
    return written


def _remove_empty(folder: Path, root: Path) -> None:
    """`folder` and the folders above it up to `root` (excluded), while they are empty."""
    while folder != root and root in folder.parents:
        try:
            folder.rmdir()
        except OSError:  # not empty (or gone): the folders above it are not empty either
            return
        folder = folder.parent
