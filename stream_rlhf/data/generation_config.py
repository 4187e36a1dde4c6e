"""A model folder's generation_config.json (what `model.generate` would sample with), as plain
values: rollout takes its temperature and top_p where the config leaves them unset
(`backends/rollout_config.py`), and its eos ids as stop tokens (`data/tokenizer.py`).

    settings = read_generation_config("models/qwen2.5-vl")   # {"temperature": 0.7, "eos_token_id": [..]} or {}
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

GENERATION_CONFIG = "generation_config.json"


def read_generation_config(folder: str | Path | None) -> dict[str, Any]:
    """The settings of `folder`/generation_config.json; {} without a folder or the file."""
    path = None if folder is None else Path(folder) / GENERATION_CONFIG
    if path is None or not path.is_file():
        return {}
    return json.loads(path.read_text())
