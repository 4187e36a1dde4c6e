"""Folders built once and shared by runs (the warm start, generated datasets), safe when runs
that need the same folder start together.

    folder = build_once(Path("runs/.cache/tiny-1234"), "config.json", lambda tmp: save_everything(tmp))
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path


def build_once(folder: Path, marker: str, build: Callable[[Path], None]) -> Path:
    """`folder`, built by `build` the first time: into a folder of this process's own, renamed into
    place when complete, so a crash never leaves a folder that looks finished. `marker` is a file
    a finished folder holds; when another run finished first, its folder is used."""
    if (folder / marker).is_file():
        return folder
    partial = folder.with_name(f"{folder.name}.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    build(partial)
    try:
        partial.rename(folder)
    except OSError:
        if not (folder / marker).is_file():
            raise
        shutil.rmtree(partial)
    return folder
