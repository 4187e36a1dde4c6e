"""Environments in processes of their own (`env.processes: N`): for environments whose work holds
the GIL (a verifier in pure Python, a simulator) and would slow rollout's decode loop, or whose
calls may hang past any timeout (a thread cannot be stopped; a process can).

    envs = ProcessEnvs(cfg, threads=64)        # starts cfg.processes worker processes
    env = envs.make()                          # a proxy: async reset / step / close, as the stepper calls them
    ...
    envs.close()                               # stops every worker process

Each episode's environment lives in one worker process (`env_worker.py`) for its whole life; a
new episode goes to the worker with the fewest episodes. The proxy's calls send the episode key,
the method and its arguments (pickled: `EpisodeStart`, the turn's text and ids) and await the
reply, so the stepper bounds them by `env.step_timeout_s` as it does in-process calls. What a call
raises in the worker comes back as `EnvProcessError` naming the environment's method and error.

- **A call past its timeout** fails its episode ("timeout") as in-process; its worker takes no new
  episode, and once its other episodes are over it is killed (taking the stuck call with it) and
  replaced at the next `make`.
- **A worker that dies** (killed, crashed) fails the calls of its episodes ("raised", naming its
  exit code); the other workers' episodes go on, and a new worker is started at the next `make`.
- Workers start with the pool, as `python -m stream_rlhf.envs.env_worker` with the rollout
  process's `sys.path` (a fresh interpreter: the rollout process holds threads, fork is unsafe,
  and nothing of its `__main__` is run again); the pool waits until each has imported the factory
  and the tools (a worker that cannot is a RuntimeError naming the import's error), so no call's
  timeout pays for imports. A replacement starts at the next `make`, which waits for it only when
  no other worker is ready. Workers die with the rollout process (`child_signals`).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import subprocess
import threading
from collections.abc import Sequence
from concurrent.futures import Future, InvalidStateError
from typing import Any

from stream_rlhf.envs.config import EnvConfig
from stream_rlhf.envs.env_worker import Reply
from stream_rlhf.envs.environment import EpisodeStart, Turn
from stream_rlhf.worker_process import READY, start_worker

log = logging.getLogger("stream_rlhf")
KILL_WAIT_S = 5.0
"""How long a closed worker gets to exit before it is killed."""
START_TIMEOUT_S = 120.0
"""How long a worker may take to import the factory and the tools."""


class EnvProcessError(RuntimeError):
    """A call that failed in an environment process (its message names the method and error)."""


class _Worker:
    """One environment process, its end of the socket pair, and the replies it owes."""

    def __init__(self, cfg: EnvConfig, threads: int, index: int):
        self.name = f"env process {index}"
        self.process, self.conn = start_worker("stream_rlhf.envs.env_worker", (cfg, threads))
        self.lock = threading.Lock()
        self.pending: dict[int, Future[Reply]] = {}
        self.call_ids = itertools.count()
        self.episodes: set[int] = set()
        self.stuck = False
        """A call of it ran past its timeout: it takes no new episode and is retired when it has none."""
        self.dead: str | None = None
        """Why it can take no call (it exited, or was retired)."""
        self.ready = threading.Event()
        """Set once its factory and tools have imported, or once it is dead."""
        self.reader = threading.Thread(target=self._read, name=f"{self.name} replies", daemon=True)
        self.reader.start()

    @property
    def usable(self) -> bool:
        return self.dead is None and not self.stuck

    def wait_ready(self) -> None:
        """Blocks until it is ready; RuntimeError if it failed to start."""
        if not self.ready.wait(START_TIMEOUT_S):
            self.retire()
            raise RuntimeError(f"env.processes: {self.name} was not ready within {START_TIMEOUT_S:.0f} s")
        if self.dead is not None:
            raise RuntimeError(f"env.processes: {self.dead}")

    def call(self, key: int, method: str, args: tuple[Any, ...]) -> Future[Reply]:
        future: Future[Reply] = Future()
        with self.lock:
            if self.dead is not None:
                future.set_exception(EnvProcessError(self.dead))
                return future
            call_id = next(self.call_ids)
            try:
                self.conn.send((call_id, key, method, args))
            except OSError as exc:  # it died and the reader has not seen it yet
                future.set_exception(EnvProcessError(f"{self.name} is gone ({type(exc).__name__})"))
                return future
            self.pending[call_id] = future
        return future

    def retire(self) -> None:
        """Take no more calls and kill the process (a call may hold it for good)."""
        with self.lock:
            self.dead = self.dead or f"{self.name} was retired"
        self.process.kill()

    def stop(self) -> None:
        """Ask the process to end (it exits at once: its episodes are over)."""
        with self.lock:
            self.dead = self.dead or f"{self.name} was stopped"
            try:
                self.conn.send(None)
            except OSError:  # already gone
                pass

    def _read(self) -> None:
        while True:
            try:
                call_id, ok, value = self.conn.recv()
            except (EOFError, OSError):
                break
            if call_id == READY:
                if not ok:
                    with self.lock:
                        self.dead = f"{self.name} could not import env.factory or env.tools: {value}"
                self.ready.set()
                continue
            with self.lock:
                future = self.pending.pop(call_id, None)
            if future is not None:
                _settle(future, (call_id, ok, value))
        try:
            code: int | None = self.process.wait(timeout=KILL_WAIT_S)
        except subprocess.TimeoutExpired:  # its end of the socket closed, and it lives on
            code = None
        with self.lock:
            if self.dead is None:
                self.dead = f"{self.name} (pid {self.process.pid}) exited with {code}"
                log.warning("%s: the calls of its episodes fail; a new process replaces it", self.dead)
            pending, self.pending = list(self.pending.values()), {}
            self.conn.close()
        self.ready.set()
        for future in pending:
            if not future.done():
                future.set_exception(EnvProcessError(self.dead))


def _settle(future: Future[Reply], reply: Reply) -> None:
    try:
        future.set_result(reply)
    except InvalidStateError:  # its call was given up (timed out, or rollout stopped)
        pass


class ProcessEnvironment:
    """One episode's environment, living in a worker process; the stepper calls it as any async
    environment."""

    def __init__(self, envs: ProcessEnvs, worker: _Worker, key: int):
        self.envs, self.worker, self.key = envs, worker, key

    async def reset(self, start: EpisodeStart) -> None:
        await self._call("reset", (start,))

    async def step(self, text: str, token_ids: Sequence[int]) -> Turn:
        return await self._call("step", (text, list(token_ids)))

    async def close(self) -> None:
        """The environment's own close() in its process (if it has one); frees its place there."""
        try:
            await self._call("close", ())
        finally:
            self.envs.released(self.worker, self.key)

    async def _call(self, method: str, args: tuple[Any, ...]) -> Any:
        try:
            _, ok, value = await asyncio.wrap_future(self.worker.call(self.key, method, args))
        except asyncio.CancelledError:  # past its timeout: the call may hold the worker's thread for good
            self.worker.stuck = True
            raise
        if not ok:
            raise EnvProcessError(f"{value} (in {self.worker.name})")
        return value


class ProcessEnvs:
    """Makes each episode's environment in one of `cfg.processes` worker processes."""

    def __init__(self, cfg: EnvConfig, threads: int):
        """`threads`: per worker, for its environments' sync calls."""
        if cfg.processes < 1:
            raise ValueError(f"ProcessEnvs: env.processes={cfg.processes}, expected >= 1")
        self.cfg, self.threads = cfg, threads
        self.workers: list[_Worker] = []
        self.keys = itertools.count()
        self.started = 0
        """Workers started so far (replacements included: `replaced`)."""
        self.lock = threading.Lock()
        for _ in range(cfg.processes):
            self._start()
        try:
            for worker in self.workers:
                worker.wait_ready()
        except RuntimeError:
            self.close()
            raise

    def _start(self) -> _Worker:
        worker = _Worker(self.cfg, self.threads, self.started)
        self.started += 1
        self.workers.append(worker)
        return worker

    @property
    def replaced(self) -> int:
        """Workers started to replace one that died or was retired."""
        return max(0, self.started - self.cfg.processes)

    def make(self) -> ProcessEnvironment:
        """A new episode's environment, in the ready worker with the fewest episodes. A worker is
        started while fewer than `cfg.processes` are usable; only when none is ready does this
        wait for one to start."""
        with self.lock:
            self.workers = [w for w in self.workers if w.dead is None]
            if sum(w.usable for w in self.workers) < self.cfg.processes:
                self._start()
            usable = [w for w in self.workers if w.usable]
        ready = [w for w in usable if w.ready.is_set()]
        if not ready:
            usable[0].wait_ready()
            ready = usable[:1]
        worker = min(ready, key=lambda w: len(w.episodes))
        with self.lock:
            key = next(self.keys)
            worker.episodes.add(key)
        return ProcessEnvironment(self, worker, key)

    def released(self, worker: _Worker, key: int) -> None:
        """Episode `key` is over; a stuck worker left without episodes is retired."""
        with self.lock:
            worker.episodes.discard(key)
            retire = worker.stuck and not worker.episodes and worker.dead is None
        if retire:
            log.warning("%s (pid %d) had a call past env.step_timeout_s: killed now that its episodes are over "
                        "(new episodes go to a worker started in its place)", worker.name, worker.process.pid)
            worker.retire()

    def close(self) -> None:
        """Every worker ends (killed after KILL_WAIT_S); call it after the stepper's close, which
        closes the environments still in flight."""
        with self.lock:
            workers, self.workers = self.workers, []
        for worker in workers:
            worker.stop()
        for worker in workers:
            try:
                worker.process.wait(timeout=KILL_WAIT_S)
            except subprocess.TimeoutExpired:
                worker.process.kill()
            worker.reader.join(timeout=KILL_WAIT_S)
