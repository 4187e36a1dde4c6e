"""How the local launcher starts processes (`launch/process_start.py`): forked from a fork server
that imported torch once, with the launcher's environment of the moment, sharing the server's pages;
`stream-rlhf run` starts that server first thing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from stream_rlhf.launch.process_start import (
    START_METHOD_VARIABLE,
    fork_server_pid,
    in_child,
    launcher_state,
    start_context,
)
from tests.rl_tiny import tiny_job, write_job

pytestmark = pytest.mark.slow  # each test starts processes (the first one the fork server, which imports torch)

def write_environment_and_torch_state(path: str, variable: str) -> None:
    import sys

    Path(path).write_text(f"{os.environ.get(variable)} {'torch' in sys.modules}")


def start(context, path: Path, variable: str) -> None:
    process = context.Process(target=in_child, args=(launcher_state(), write_environment_and_torch_state, str(path),
                                                     variable))
    process.start()
    process.join(60)
    assert process.exitcode == 0


@pytest.mark.skipif(os.environ.get(START_METHOD_VARIABLE) == "spawn", reason="this run spawns its processes")
def test_a_forked_stage_sees_the_launchers_environment_of_now_and_the_servers_torch(tmp_path, monkeypatch):
    context = start_context()
    assert context.get_start_method() == "forkserver"
    start(context, tmp_path / "first", "SRLHF_TEST_VALUE")  # the fork server runs from here on
    server = fork_server_pid()
    assert server is not None and Path(f"/proc/{server}").exists()
    monkeypatch.setenv("SRLHF_TEST_VALUE", "set after the server started")
    start(context, tmp_path / "second", "SRLHF_TEST_VALUE")
    assert (tmp_path / "first").read_text() == "None True"  # torch came with the fork, never imported here
    assert (tmp_path / "second").read_text() == "set after the server started True"
    assert fork_server_pid() == server  # one server for every process this launcher starts


def test_spawn_when_asked(monkeypatch, tmp_path):
    monkeypatch.setenv(START_METHOD_VARIABLE, "spawn")
    context = start_context()
    assert context.get_start_method() == "spawn"
    start(context, tmp_path / "spawned", START_METHOD_VARIABLE)
    assert (tmp_path / "spawned").read_text() == "spawn False"  # a fresh interpreter: nothing imported yet


def say(text: str) -> None:
    os.write(2, text.encode())


@pytest.mark.skipif(os.environ.get(START_METHOD_VARIABLE) == "spawn", reason="this run spawns its processes")
def test_a_forked_stage_writes_to_the_launchers_stderr_of_now(tmp_path):
    """The fork server kept the stderr it started with; a stage writes where the launcher's goes now."""
    context = start_context()
    start(context, tmp_path / "warm", "HOME")  # the fork server runs (with whatever stderr was then)
    saved = os.dup(2)
    with (tmp_path / "stderr").open("wb") as now:
        os.dup2(now.fileno(), 2)
        try:
            process = context.Process(target=in_child, args=(launcher_state(), say, "from the stage\n"))
            process.start()
            process.join(60)
        finally:
            os.dup2(saved, 2)
            os.close(saved)
    assert process.exitcode == 0
    assert "from the stage" in (tmp_path / "stderr").read_text()


@pytest.mark.skipif(os.environ.get(START_METHOD_VARIABLE) == "spawn", reason="this run spawns its processes")
@pytest.mark.parametrize(("sets", "started"), [((), True), (("--set", "launcher=ray"), False)])
def test_run_starts_the_fork_server_first_for_a_local_job_only(tmp_path, sets, started):
    """`stream-rlhf run` of a local job starts the server before anything else (here a config error
    ends the run), so that its imports overlap the driver's; a Ray job's driver starts none."""
    config = write_job(tmp_path / "job.yaml", tiny_job(tmp_path, "early", **{"rollout.no_such_key": 1}))
    script = ("import sys; from stream_rlhf import cli; from stream_rlhf.launch.process_start import fork_server_pid; "
              "code = cli.main(['run', *sys.argv[1:]]); print(code, fork_server_pid() is not None)")
    result = subprocess.run([sys.executable, "-c", script, str(config), *sets], capture_output=True, text=True,
                            timeout=120)
    assert result.stdout.split() == ["2", str(started)], result.stderr[-2000:]
    assert "rollout.no_such_key" in result.stderr
