"""`cli.py`: the parser and its dispatch to `stream_rlhf/commands/`. Importing it stays light, so
that `stream-rlhf run` starts the fork server before this process imports torch; and the program
exits with the command's code."""

from __future__ import annotations

import subprocess
import sys

import pytest

from stream_rlhf import cli
from tests.bench_run import REPO


@pytest.mark.parametrize("name", sorted(cli.COMMANDS))
def test_every_sub_command_parses_and_resolves_to_its_function(name, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main([name, "--help"])
    assert exit_.value.code == 0 and f"usage: stream-rlhf {name}" in capsys.readouterr().out
    assert callable(cli.command(name)) and cli.command(name).__name__ == f"cmd_{name.replace('-', '_')}"


def test_the_parser_offers_exactly_the_commands_it_dispatches(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    usage = capsys.readouterr().out
    assert "{" + ",".join(cli.COMMANDS) + "}" in usage


def test_importing_the_cli_imports_no_torch_and_the_program_exits_with_the_command_code(tmp_path):
    script = "import sys; import stream_rlhf.cli; print(sorted({'torch', 'transformers'} & set(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert result.stdout.strip() == "[]", result.stderr[-2000:]
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: bad\nno_such_key: 1\n")
    result = subprocess.run([sys.executable, "-m", "stream_rlhf.cli", "plan", str(bad)], capture_output=True,
                            text=True, timeout=120, cwd=REPO)
    assert result.returncode == 2 and "config error: no_such_key: unknown key" in result.stderr, result.stderr[-2000:]
