"""How the local launcher starts its processes: forked from a server that imported torch once.

    context = start_context()
    context.Process(target=in_child, args=(dict(os.environ), _stage_main, *args)).start()

Every stage process needs torch, transformers and the model code; imported by each process on its
own (multiprocessing's `spawn`) they cost ~310 MB of PSS per process, 260 MB of it private
(measured on the CPU build here: a stage that imported them and ran a tiny model). Forked from
multiprocessing's fork server, a fresh single-threaded process that imported them once (PRELOAD) and
runs nothing else, the processes share those pages copy-on-write: ~90 MB of PSS each, 20 MB
private, and they start faster. The fork server starts no threads and touches no CUDA, so forking
it is safe where forking the launcher (threads, sockets) would not be; it ignores Ctrl-C and exits
when the launcher does, which sends every stage SIGTERM (`child_process.child_signals`): multiprocessing
hands each forked process the launcher's end of the pipe the server watches for that, which would
keep the server (and so the stages) alive after a killed launcher, so `in_child` closes it. Where there is no
fork server (not Linux, or `STREAM_RLHF_START=spawn`), processes are spawned as before.

The environment and stdout/stderr: a forked process starts from the fork server's, which are the
launcher's when the server started. `in_child` puts the launcher's environment of now in place
first, so a variable set later (a test's, a launcher's) reaches the stage as with spawn (modules in
PRELOAD read theirs when the server imported them); and where the launcher's stdout or stderr is
no longer the file the server inherited (pytest's capture of a later test, say), it writes to the
launcher's (reopened through /proc, appending).
"""

from __future__ import annotations

import multiprocessing as mp
import os
from collections.abc import Callable
from multiprocessing import forkserver
from multiprocessing.context import BaseContext

from stream_rlhf.child_process import child_signals
from stream_rlhf.launch.spec import setup_logging

PRELOAD = ["torch", "numpy", "zmq", "msgspec", "safetensors.torch", "transformers",
           "transformers.models.qwen2.modeling_qwen2", "transformers.models.qwen2_vl.modeling_qwen2_vl"]
"""What the fork server imports once: the heavy libraries every stage loads, never project code
(whose modules may read the environment when imported)."""
FORK_SERVER = "fork_server"
"""The fork server's name among the job's processes (`LocalJob.pids`, the summary's memory block)."""
START_METHOD_VARIABLE = "STREAM_RLHF_START"
"""`spawn` here makes the local launcher spawn its processes (each imports everything itself)."""


def start_context() -> BaseContext:
    """The multiprocessing context the local launcher starts processes with (module docstring)."""
    if os.environ.get(START_METHOD_VARIABLE) == "spawn" or "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)  # no effect once this process's server runs: the first list stays
    return context


def start_fork_server() -> None:
    """Start the fork server now rather than with the job's first process: its imports (PRELOAD,
    seconds of torch and transformers) then run beside the launcher's own (a driver imports the
    same libraries, warm-starts and evaluates before its job starts). A no-op where processes are
    spawned, and when the server runs already."""
    if start_context().get_start_method() == "forkserver":
        forkserver.ensure_running()


def in_child(launcher: tuple[int, dict[str, str]], target: Callable[..., None], *args: object) -> None:
    """A started process's first step: the launcher's (pid, environment) and its stdout and stderr,
    signals and logging, then `target`."""
    pid, env = launcher
    _let_the_fork_server_go()
    os.environ.clear()
    os.environ.update(env)
    for fd in (1, 2):
        _follow(pid, fd)
    child_signals()
    setup_logging()
    target(*args)


def launcher_state() -> tuple[int, dict[str, str]]:
    """What `in_child` needs of the launcher, taken when it starts a process."""
    return os.getpid(), dict(os.environ)


def _let_the_fork_server_go() -> None:
    """Close this process's copy of the launcher's end of the fork server's "launcher alive" pipe
    (module docstring); a spawned process has none."""
    server = forkserver._forkserver
    alive = getattr(server, "_forkserver_alive_fd", None)
    if isinstance(alive, int):
        os.close(alive)
        server._forkserver_alive_fd = None


def _follow(launcher_pid: int, fd: int) -> None:
    """Make `fd` the launcher's `fd` when it is another file than this process inherited."""
    theirs = f"/proc/{launcher_pid}/fd/{fd}"
    try:
        if os.path.samestat(os.stat(theirs), os.fstat(fd)):
            return  # the same file: spawned, or a launcher whose stdio never changed
        reopened = os.open(theirs, os.O_WRONLY | os.O_APPEND)
    except OSError:
        return  # no /proc, a socket, a closed fd: keep what was inherited
    os.dup2(reopened, fd)
    os.close(reopened)


def fork_server_pid() -> int | None:
    """The fork server's process id while it runs (its memory is the shared part of every stage's)."""
    pid = getattr(forkserver._forkserver, "_forkserver_pid", None)  # multiprocessing keeps it there
    return pid if isinstance(pid, int) else None
