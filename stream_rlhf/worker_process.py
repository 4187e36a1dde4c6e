"""A helper process on one end of a socket pair: what the environment processes (`env.processes`)
and the reward processes (`reward.workers`) are started with.

    process, conn = start_worker("stream_rlhf.rl.reward_worker", hello)   # parent: `python -m MODULE FD`
    conn, hello = worker_connection()                                     # child, in its __main__

A fresh interpreter, not a fork (the parent holds threads) and not `multiprocessing` (nothing of the
parent's `__main__` runs again). The parent sends `hello` first, with its `sys.path` appended, so the
worker imports what the parent can; `worker_connection` sets that path, makes the child die with its
parent (`child_signals`) and returns the connection and `hello`. A worker's first reply has index
READY.
"""

from __future__ import annotations

import socket
import subprocess
import sys
from multiprocessing.connection import Connection
from typing import Any

from stream_rlhf.child_process import child_signals

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
    conn = Connection(int(sys.argv[1]))
    hello, sys.path[:] = conn.recv()
    return conn, hello
