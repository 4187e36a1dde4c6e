"""`scripts/gpu_checks.sh` runs only on a lent GPU machine, with minutes of device time a session:
here, without a GPU, its shell parses, every file it names exists, and every flag it gives a
benchmark is one that benchmark's `--help` lists (with the values its choices allow), so a GPU
session is never spent on a typo."""

from __future__ import annotations

import json
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


HELPS = """
import contextlib, io, json, runpy, sys
sys.path.insert(0, "bench")  # the benchmarks import their neighbours
helps = {}
for bench in sys.argv[1:]:
    sys.argv = [bench, "--help"]
    with contextlib.redirect_stdout(io.StringIO()) as out, contextlib.suppress(SystemExit):
        runpy.run_path(bench, run_name="__main__")
    helps[bench] = out.getvalue()
print(json.dumps(helps))
"""


def bench_helps(benches: list[str]) -> dict[str, str]:
    """Each benchmark's `--help`, all in one process (torch imported once)."""
    result = subprocess.run([sys.executable, "-c", HELPS, *benches], cwd=REPO, check=True, capture_output=True,
                            text=True, timeout=300)
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_the_script_parses_and_names_files_that_exist():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    text = SCRIPT.read_text()
    named = set(re.findall(r"\b((?:bench|tests|configs)/[\w/]+\.(?:py|yaml))", text))
    assert named and not [path for path in sorted(named) if not (REPO / path).exists()]


@pytest.mark.slow
def test_every_benchmark_flag_the_script_gives_is_one_the_benchmark_takes():
    calls = bench_calls()
    assert {bench for bench, _ in calls} >= {"bench/vs_trl.py", "bench/agentic.py", "bench/gpu_sharing.py"}
    helps = bench_helps(sorted({bench for bench, _ in calls}))
    assert all("usage:" in text for text in helps.values()), helps
    for bench, words in calls:
        flags = [word for word in words if word.startswith("--")]
        unknown = [flag for flag in flags if not re.search(rf"{re.escape(flag)}\b", helps[bench])]
        assert not unknown, f"{bench} takes no {unknown}"
        for flag in flags:  # a flag with choices ({a,b} in --help) gets values among them
            choices = re.search(rf"{re.escape(flag)} \{{([^}}]+)\}}", helps[bench])
            after = words[words.index(flag) + 1:]
            values = after[:next((i for i, w in enumerate(after) if w.startswith("--")), len(after))]
            if choices:
                assert values and set(values) <= set(choices.group(1).split(",")), (bench, flag, values)
