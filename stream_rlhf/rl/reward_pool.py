"""The rule-based rewards in processes of their own (`reward.workers: N`): N samples scored at once,
each call bounded by `reward.timeout_s`. For a verifier that is slow in pure Python (one process
would score a mini-batch one sample after another, holding the GIL) or that may never return (a
symbolic simplification that blows up: a thread cannot be stopped, a process can).

    pool = RewardPool({OUTCOME: "mypkg.verify:score", STEPS: "mypkg.verify:steps"}, workers=4,
                      timeout_s=10.0, timeout_score=0.0)
    scores, timeouts = pool.run(OUTCOME, [(prompt, response, reference, kwargs), ...])  # in sample order
    step_scores, timeouts = pool.run(STEPS, [(prompt, steps, reference, {}), ...])     # a list per sample
    pool.close()

Two kinds of function, both optional: the outcome (`reward.function`, one finite float per sample)
and the process rewards' rule (`reward.process.function`, one finite float per step); every
worker imports both. Each worker (`reward_worker.py`) scores one sample at a time; the pool keeps
every worker busy until the list is done. A call past `timeout_s` scores `timeout_score` (each
step of it, for STEPS), and its message (naming the sample and the reference) is returned in
`timeouts`; its worker is killed and a new one started. A function that raises or returns
something other than its kind's finite numbers is a `RewardError` naming the sample, as it would
be in the stage's own process; so is a worker that dies. Workers start with the pool (as
`python -m stream_rlhf.rl.reward_worker`, with this process's `sys.path`), which waits until each
has imported the functions.
"""

from __future__ import annotations

import logging
import subprocess
import time
from collections import deque
from multiprocessing.connection import Connection, wait
from typing import Any, Literal

from stream_rlhf.worker_process import READY, start_worker

log = logging.getLogger("stream_rlhf")
MAX_TIMEOUTS_LOGGED = 3
"""Timed-out calls `log_timeouts` logs of one list (all are counted)."""
START_TIMEOUT_S = 120.0
"""How long a worker may take to import the function."""
Kind = Literal["outcome", "steps"]
OUTCOME: Kind = "outcome"
"""`fn(prompt, response, reference, **extra) -> float` (`reward.function`)."""
STEPS: Kind = "steps"
"""`fn(prompt, steps, reference) -> list[float]`, one score per step (`reward.process.function`)."""
CONFIG_KEYS: dict[Kind, str] = {OUTCOME: "reward.function", STEPS: "reward.process.function"}
Call = tuple[str, str | list[str], str, dict[str, Any]]
"""(prompt, response or steps, reference, extra keyword arguments) of one sample."""
Score = float | list[float]


def log_timeouts(messages: list[str]) -> int:
    """Logs the first MAX_TIMEOUTS_LOGGED of one `run`'s timed-out calls; how many there were."""
    for message in messages[:MAX_TIMEOUTS_LOGGED]:
        log.warning("reward: %s", message)
    return len(messages)


class RewardError(RuntimeError):
    """The reward function failed for a sample (raised, returned a non-number, or its process died)."""


class _Worker:
    """One reward process and its end of the socket pair."""

    def __init__(self, functions: dict[Kind, str]):
        self.process, self.conn = start_worker("stream_rlhf.rl.reward_worker", functions)

    def wait_ready(self) -> None:
        """Blocks until the functions imported; RewardError when one did not."""
        if not self.conn.poll(START_TIMEOUT_S):
            self.kill()
            raise RewardError(f"reward.workers: a worker did not import the functions within {START_TIMEOUT_S:.0f} s")
        try:
            index, ok, message = self.conn.recv()
            assert index == READY, f"reward worker's first reply is for sample {index}"
        except (EOFError, OSError):
            ok, message = False, f"the worker exited with {self.process.wait()}"
        if not ok:
            self.kill()
            raise RewardError(f"reward.workers: {message}")

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()
        self.conn.close()


class RewardPool:
    """`functions` (a dotted path per kind) scored in `workers` processes (see the module docstring)."""

    def __init__(self, functions: dict[Kind, str], workers: int, timeout_s: float, timeout_score: float):
        if not functions:
            raise ValueError("RewardPool: no function to run")
        self.functions, self.timeout_s, self.timeout_score = functions, timeout_s, timeout_score
        self.replaced = 0
        """Workers started in place of one that was killed (past its timeout) or died."""
        self.workers = [_Worker(functions) for _ in range(workers)]
        try:
            for worker in self.workers:
                worker.wait_ready()
        except RewardError:
            self.close()
            raise
        log.info("%s in %d processes (pids %s)",
                 ", ".join(f"{CONFIG_KEYS[kind]} {path}" for kind, path in functions.items()), workers,
                 ", ".join(str(w.process.pid) for w in self.workers))

    def run(self, kind: Kind, calls: list[Call]) -> tuple[list[Score], list[str]]:
        """Each call's score by the `kind` function, in order (`timeout_score` for one past
        `timeout_s`, for each step with STEPS), and a message per call that timed out."""
        if kind not in self.functions:
            raise ValueError(f"RewardPool: no {CONFIG_KEYS[kind]} was given to the pool")
        function = self.functions[kind]
        scores: list[Score | None] = [None] * len(calls)
        timeouts: list[str] = []
        waiting = deque(range(len(calls)))
        busy: dict[Connection, tuple[_Worker, int, float]] = {}
        """A worker's connection -> (the worker, the sample it scores, its deadline)."""
        while waiting or busy:
            for worker in self.workers:
                if waiting and all(worker is not w for w, _, _ in busy.values()):
                    index = waiting.popleft()
                    worker.conn.send((index, kind, *calls[index]))
                    busy[worker.conn] = (worker, index, time.monotonic() + self.timeout_s)
            first_deadline = min(deadline for _, _, deadline in busy.values())
            for conn in wait(list(busy), timeout=max(0.0, first_deadline - time.monotonic())):
                worker, index, _ = busy.pop(conn)
                try:
                    scores[index] = self._reply(worker, index, calls[index])
                except RewardError:
                    for other, _, _ in busy.values():  # their replies would come to the next call
                        self._replace(other)
                    raise
            for conn, (worker, index, deadline) in list(busy.items()):
                if time.monotonic() >= deadline:
                    del busy[conn]
                    _, answer, reference, _ = calls[index]
                    scores[index] = self.timeout_score if kind == OUTCOME else [self.timeout_score] * len(answer)
                    each = " for each step" if kind == STEPS else ""
                    timeouts.append(f"sample {index} (reference {reference!r:.60}): {function} ran past "
                                    f"reward.timeout_s={self.timeout_s}; scored {self.timeout_score}{each}")
                    self._replace(worker)
        return scores, timeouts  # type: ignore[return-value]

    def _reply(self, worker: _Worker, index: int, call: Call) -> Score:
        try:
            replied, ok, value = worker.conn.recv()
        except (EOFError, OSError):
            code = worker.process.wait()
            self._replace(worker)
            raise RewardError(f"sample {index}: the reward worker scoring it exited with {code}") from None
        assert replied == index, f"reward worker replied for sample {replied}, asked {index}"
        if not ok:
            raise RewardError(f"sample {index} (reference {call[2]!r:.60}): {value}")
        return value

    def _replace(self, worker: _Worker) -> None:
        """Kill `worker` and start one in its place."""
        worker.kill()
        fresh = _Worker(self.functions)
        fresh.wait_ready()
        self.workers[self.workers.index(worker)] = fresh
        self.replaced += 1

    def close(self) -> None:
        for worker in self.workers:
            worker.conn.close()  # its recv ends: the process exits
        for worker in self.workers:
            try:
                worker.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                worker.process.kill()
                worker.process.wait()
        self.workers = []
