"""`.ci/run`: the fast job first (ruff, the tests marked neither slow nor gpu), then the README's
test command verbatim as the full suite, so CI runs what a user is told to run."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def readme_test_commands() -> list[str]:
    """The README's shell lines that set up from a clone and run the test suite (in ```bash blocks)."""
    blocks = re.findall(r"```bash\n(.*?)```", (REPO / "README.md").read_text(), re.S)
    return [line for block in blocks for line in block.splitlines()
            if line.startswith("python3 -m venv") and "-m pytest" in line]


def test_ci_runs_the_readmes_test_command_verbatim_after_the_fast_job():
    commands = readme_test_commands()
    assert commands, "README.md has no ```bash line that sets up a venv and runs pytest"
    lines = (REPO / ".ci" / "run").read_text().splitlines()
    fast = lines.index('.venv/bin/python -m pytest -q -m "not slow and not gpu"')
    assert lines.index(".venv/bin/ruff check .") < fast
    for command in commands:
        assert command in lines, f".ci/run does not run the README's test command verbatim: {command}"
        assert lines.index(command) > fast
