"""Run metrics: one JSON object per line in runs/<name>/metrics.jsonl, mirrored to TensorBoard
when the `tensorboard` extra is installed.

    writer = MetricsWriter(run_dir)
    writer.write({"iteration": 3, "reward": 0.41, ...})
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class MetricsWriter:
    def __init__(self, run_dir: str | Path, filename: str = "metrics.jsonl"):
        self.path = Path(run_dir) / filename
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.tensorboard = _tensorboard(Path(run_dir) / "tensorboard")

    def write(self, record: dict[str, Any]) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self.tensorboard is not None:
            step = int(record.get("iteration", 0))
            for key, value in record.items():
                if isinstance(value, (int, float)) and key != "iteration":
                    self.tensorboard.add_scalar(key, value, step)
            self.tensorboard.flush()


def _tensorboard(folder: Path):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # the `tensorboard` extra is not installed
        return None
    return SummaryWriter(str(folder))


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The complete records of `path`; a last line without its newline is still being written."""
    path = Path(path)
    if not path.is_file():
        return []
    complete, _, _ = path.read_text().rpartition("\n")
    return [json.loads(line) for line in complete.splitlines() if line.strip()]
