"""`scripts/gpu_checks.sh` runs only on a lent GPU machine, with minutes of device time a session:
here, without a GPU, its shell parses, every file it names exists, and every flag it gives a
benchmark is one that benchmark's `--help` lists (with the values its choices allow), so a GPU
session is never spent on a typo."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "gpu_checks.sh"


def bench_calls() -> list[tuple[str, list[str]]]:
    """(benchmark, the words after it up to the end of its command) for each bench/*.py the script runs."""
    text = SCRIPT.read_text().replace("\\\n", " ")
    calls = []
    for match in re.finditer(r'"\$python" (bench/\w+\.py)([^\n;&|]*)', text):
        calls.append((match.group(1), match.group(2).split()))
    return calls


def test_the_script_parses_and_names_files_that_exist():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    text = SCRIPT.read_text()
    named = set(re.findall(r"\b((?:bench|tests|configs)/[\w/]+\.(?:py|yaml))", text))
    assert named and not [path for path in sorted(named) if not (REPO / path).exists()]


@pytest.mark.slow
def test_every_benchmark_flag_the_script_gives_is_one_the_benchmark_takes():
    calls = bench_calls()
    assert {bench for bench, _ in calls} >= {"bench/vs_trl.py", "bench/agentic.py", "bench/gpu_sharing.py"}
    helps: dict[str, str] = {}
    for bench, words in calls:
        if bench not in helps:
            helps[bench] = subprocess.run([sys.executable, bench, "--help"], cwd=REPO, check=True,
                                          capture_output=True, text=True, timeout=120).stdout
        flags = [word for word in words if word.startswith("--")]
        unknown = [flag for flag in flags if not re.search(rf"{re.escape(flag)}\b", helps[bench])]
        assert not unknown, f"{bench} takes no {unknown}"
        for flag in flags:  # a flag with choices ({a,b} in --help) gets values among them
            choices = re.search(rf"{re.escape(flag)} \{{([^}}]+)\}}", helps[bench])
            after = words[words.index(flag) + 1:]
            values = after[:next((i for i, w in enumerate(after) if w.startswith("--")), len(after))]
            if choices:
                assert values and set(values) <= set(choices.group(1).split(",")), (bench, flag, values)
