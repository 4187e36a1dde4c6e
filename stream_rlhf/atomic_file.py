"""Files that readers see whole or not at all: written under a hidden name of this thread's own
(two trainers of one process, a device group's, may write the same file at once), then renamed into
place.

    write_text_atomically(run_dir / "clocks.json", json.dumps(record))
"""

from __future__ import annotations

import os
import threading
from pathlib import Path


def write_text_atomically(path: Path, text: str) -> Path:
    """`text` into `path` (its folder made if missing), replacing what was there in one rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    staging.write_text(text)
    os.replace(staging, path)
    return path
