"""A helper process on one end of a socket pair: what the environment processes (`env.processes`)
and the reward processes (`reward.workers`) are started with.

    process, conn = start_worker("stream_rlhf.rl.reward_worker", hello)   # parent: `python -m MODULE FD`
    conn, hello = worker_connection()                                     # child, in its __main__

A fresh interpreter, not a fork (the parent holds threads) and not `multiprocessing` (nothing of the
parent's `__main__` runs again). The parent sends `hello` first, with its `sys.path` appended, so the
worker imports what the parent can; `worker_connection` sets that path, makes the child die with its
parent (`child_signals`) and returns the connection and `hello`. A worker's first reply has index
READY.

A worker runs on every core of the job on its host (`HELPER_CORES`), not on its stage's own: a
stage pinned to one core (rollout, the reward stage) would otherwise put its workers' work on that
very core, where it competes with the stage and where two workers cannot run at once.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from multiprocessing.connection import Connection
from typing import Any

from stream_rlhf.child_process import child_signals

HELPER_CORES = "STREAM_RLHF_HELPER_CORES"
"""Environment variable: the cores, comma-separated, that the workers a process starts run on. A
stage sets it to the cores it may run on before it pins itself to its own (`launch/rank.py`)."""
READY = -1
"""The index of a worker's first reply: (READY, True, None) once it can work, (READY, False,
message) when it cannot."""


def start_worker(module: str, hello: Any) -> tuple[subprocess.Popen, Connection]:
    """`python -m module FD` on one end of a new socket pair, `hello` sent to it; the process and
    this end."""
    parent_end, child_end = socket.socketpair()
    process = subprocess.Popen([sys.executable, "-m", module, str(child_end.fileno())], pass_fds=(child_end.fileno(),))
    child_end.close()
    conn = Connection(parent_end.detach())
    conn.send((hello, sys.path))
    return process, conn


def worker_connection() -> tuple[Connection, Any]:
    """In a worker started by `start_worker`: its connection and the parent's `hello`, with the
    parent's sys.path in place."""
    child_signals()
    if cores := os.environ.get(HELPER_CORES):
        os.sched_setaffinity(0, [int(core) for core in cores.split(",")])
    conn = Connection(int(sys.argv[1]))
    hello, sys.path[:] = conn.recv()
    return conn, hello
