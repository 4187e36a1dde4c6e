"""Run metrics: one JSON object per line in runs/<name>/metrics.jsonl, mirrored to TensorBoard
(runs/<name>/tensorboard/) when the `tensorboard` extra is installed.

    writer = MetricsWriter(run_dir, "actor")
    writer.write({"iteration": 3, "reward": 0.41, ...})   # TensorBoard: actor/reward at step 3

Every trainer writes its own JSONL file with plain keys; in TensorBoard, where they share one
folder, each tag is prefixed by the writer's role (`actor/loss`, `critic/value_loss`,
`medusa/loss`) so their curves never collide.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class MetricsWriter:
    def __init__(self, run_dir: str | Path, role: str, filename: str = "metrics.jsonl", purge_step: int = 0):
        """`role` prefixes the TensorBoard tags. `purge_step` > 0 (a resumed run): TensorBoard
        forgets what an earlier run of this folder logged from that iteration on, as the driver
        cut the JSONL files there."""
        self.role = role
        self.path = Path(run_dir) / filename
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.tensorboard = _tensorboard(Path(run_dir) / "tensorboard", purge_step)

    def write(self, record: dict[str, Any]) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self.tensorboard is not None:
            step = int(record.get("iteration", 0))
            for key, value in record.items():
                if isinstance(value, (int, float)) and key != "iteration":
                    self.tensorboard.add_scalar(f"{self.role}/{key}", value, step)
            self.tensorboard.flush()


def _tensorboard(folder: Path, purge_step: int):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # the `tensorboard` extra is not installed
        return None
    return SummaryWriter(str(folder), purge_step=purge_step or None)


def cut_metrics(path: str | Path, version: int) -> None:
    """Keep the records of iterations before `version` (a run resuming from that checkpoint
    writes the rest again) and drop a torn last line."""
    path = Path(path)
    if path.is_file():
        kept = [r for r in read_metrics(path) if int(r.get("iteration", 0)) < version]
        path.write_text("".join(json.dumps(r) + "\n" for r in kept))


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The complete records of `path`; a last line without its newline is still being written."""
    path = Path(path)
    if not path.is_file():
        return []
    complete, _, _ = path.read_text().rpartition("\n")
    return [json.loads(line) for line in complete.splitlines() if line.strip()]
