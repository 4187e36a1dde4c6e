"""POSIX shared-memory segments: create, map, unlink, and sweep the ones a dead process left.

Segments are named `/{prefix}_{pid}_{n}` so that whoever finds one can tell which process made it.
The standard library's `multiprocessing.shared_memory` is avoided on purpose: before Python 3.13
it registers attached segments with a resource tracker that unlinks them when the *consumer*
exits, which would destroy a producer's payload under every other consumer.
"""

from __future__ import annotations

import logging
import mmap
import os
import re
import socket
from pathlib import Path

import _posixshmem

log = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")


def host_id() -> str:
    """Identifies this host's shared-memory namespace (override: STREAM_RLHF_HOST_ID)."""
    override = os.environ.get("STREAM_RLHF_HOST_ID")
    if override:
        return override
    boot = Path("/proc/sys/kernel/random/boot_id")
    suffix = boot.read_text().strip()[:8] if boot.exists() else ""
    return f"{socket.gethostname()}:{suffix}"


def create(name: str, size: int) -> mmap.mmap:
    """Create segment `name` (leading "/") of `size` bytes and map it read-write."""
    fd = _posixshmem.shm_open(name, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode=0o600)
    try:
        os.ftruncate(fd, max(size, 1))
        return mmap.mmap(fd, max(size, 1))
    except BaseException:
        unlink(name)
        raise
    finally:
        os.close(fd)


def attach(name: str) -> mmap.mmap:
    """Map an existing segment copy-on-write: reads share the producer's pages (zero-copy), a
    consumer that writes into its tensors gets private pages and never corrupts other readers."""
    fd = _posixshmem.shm_open(name, os.O_RDWR, mode=0o600)
    try:
        return mmap.mmap(fd, os.fstat(fd).st_size, access=mmap.ACCESS_COPY)
    finally:
        os.close(fd)


def unlink(name: str) -> bool:
    """Remove segment `name`; False if it was already gone. Live mappings stay valid."""
    try:
        _posixshmem.shm_unlink(name)
        return True
    except FileNotFoundError:
        return False


def segment_name(prefix: str, pid: int, counter: int) -> str:
    return f"/{prefix}_{pid}_{counter}"


def list_segments(prefix: str) -> list[tuple[str, int]]:
    """(name, creator pid) of every segment of `prefix` on this host (Linux: /dev/shm)."""
    if not SHM_DIR.is_dir():
        return []
    pattern = re.compile(rf"^{re.escape(prefix)}_(\d+)_\d+$")
    found = []
    for entry in SHM_DIR.iterdir():
        match = pattern.match(entry.name)
        if match:
            found.append(("/" + entry.name, int(match.group(1))))
    return found


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep(prefix: str, pids: set[int] | None = None) -> int:
    """Unlink segments of `prefix` whose creator is dead (or, given `pids`, made by those pids
    and dead). Returns how many were removed."""
    removed = 0
    for name, pid in list_segments(prefix):
        if pids is not None and pid not in pids:
            continue
        if pid_alive(pid):
            continue
        removed += unlink(name)
    if removed:
        log.info("reclaimed %d shared-memory segment(s) of dead processes (prefix %s)", removed, prefix)
    return removed
