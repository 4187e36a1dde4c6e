"""Where the tests find vLLM: the Python of `.venv-vllm` (made by `scripts/setup_vllm_cpu.sh`,
which the README's test command runs), or $STREAM_RLHF_VLLM_PYTHON.

A vLLM test never skips for a missing vLLM: it fails and says how to make the environment
(deselect them with `-m "not vllm"` to run the rest without it).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def vllm_python() -> str:
    python = os.environ.get("STREAM_RLHF_VLLM_PYTHON") or str(REPO / ".venv-vllm" / "bin" / "python")
    if not os.access(python, os.X_OK):
        pytest.fail(f"no vLLM environment at {python}: run scripts/setup_vllm_cpu.sh (or set "
                    "STREAM_RLHF_VLLM_PYTHON), or deselect these tests with -m 'not vllm'", pytrace=False)
    return python
