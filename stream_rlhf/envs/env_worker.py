"""An environment process (`env.processes`, `process_envs.py`), run as
`python -m stream_rlhf.envs.env_worker FD` (`worker_process.py`): it holds the environments
of the episodes given to it and runs their calls, as the stepper would in the rollout process.

    request   (call id, episode key, "reset" | "step" | "close", args)     parent -> worker
    reply     (call id, True, result) | (call id, False, message)          worker -> parent

The first reply says the process is ready (its factory and tools imported: a call's timeout never
pays for the imports). None asks the process to end. A "reset" of a key not seen yet makes its
environment first (`EnvConfig.make`); a "close" calls the environment's own `close()` if it has
one and forgets it. Calls run concurrently on one asyncio loop (`async def` methods awaited, sync
ones in a pool of `threads` threads); the parent bounds each by `env.step_timeout_s`, and a
process whose call ran past it is retired by the parent once its other episodes are over.
Whatever a call raises comes back as a message; the process ends when the parent asks or closes
its end of the socket, or dies with it.
"""

from __future__ import annotations

import asyncio
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from typing import Any

from stream_rlhf.config import import_dotted
from stream_rlhf.envs.config import EnvConfig
from stream_rlhf.envs.environment import Environment
from stream_rlhf.envs.stepper import run_call
from stream_rlhf.worker_process import READY, worker_connection

Request = tuple[int, int, str, tuple[Any, ...]]
Reply = tuple[int, bool, Any]


def serve(conn: Connection, hello: tuple[EnvConfig, int]) -> None:
    """Answer `conn`'s requests until the parent closes it; `hello`: the env config and the threads
    for sync calls."""
    cfg, threads = hello
    try:
        import_dotted(cfg.factory, "env.factory")
        cfg.tool_functions()
    except Exception as exc:
        conn.send((READY, False, f"{type(exc).__name__}: {exc}"))
        os._exit(1)
    worker = _Worker(conn, cfg, threads)
    conn.send((READY, True, None))
    while True:
        try:
            request: Request | None = conn.recv()
        except (EOFError, OSError):
            break
        if request is None:  # the parent's stop
            break
        asyncio.run_coroutine_threadsafe(worker.call(*request), worker.loop)
    os._exit(0)  # without waiting for a call stuck in a thread


class _Worker:
    def __init__(self, conn: Connection, cfg: EnvConfig, threads: int):
        self.conn, self.cfg = conn, cfg
        self.envs: dict[int, Environment] = {}
        """By episode key; touched on the loop's thread only."""
        self.send_lock = threading.Lock()
        self.executor = ThreadPoolExecutor(threads, thread_name_prefix="env-call")
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name="env-worker", daemon=True).start()

    async def call(self, call_id: int, key: int, method: str, args: tuple[Any, ...]) -> None:
        if method == "reset" and key not in self.envs:
            try:
                self.envs[key] = self.cfg.make()
            except Exception as exc:  # as a factory that raises in the rollout process: the episode fails
                self._reply(call_id, False, f"env.factory raised {type(exc).__name__}: {exc}")
                return
        env = self.envs.pop(key, None) if method == "close" else self.envs.get(key)
        if env is None and method != "close":
            self._reply(call_id, False, f"{method}: episode {key} has no environment in this process")
            return
        function = getattr(env, method, None)
        try:
            result = await run_call(function, args, self.executor) if callable(function) else None
        except Exception as exc:  # the environment's error goes back to its episode, as in-process
            self._reply(call_id, False, f"{_name(function)} raised {type(exc).__name__}: {exc}")
        else:
            self._reply(call_id, True, result)

    def _reply(self, call_id: int, ok: bool, value: Any) -> None:
        with self.send_lock:
            try:
                self.conn.send((call_id, ok, value))
            except (OSError, EOFError):  # the parent is gone: the main thread's recv ends the process
                pass
            except Exception as exc:  # a result that cannot be pickled
                self.conn.send((call_id, False, f"its result cannot be sent from the environment process "
                                                f"({type(exc).__name__}: {exc})"))


def _name(function: Any) -> str:
    return getattr(function, "__qualname__", "the environment's call")


if __name__ == "__main__":
    serve(*worker_connection())
