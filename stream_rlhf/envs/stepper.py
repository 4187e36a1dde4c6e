"""Environment calls run outside the decode loop, so a tool that takes 50 ms never stalls the
sampler: while one episode waits, the others keep generating.

    stepper = EnvStepper(step_timeout_s=30.0, workers=16)
    stepper.reset(episode_id, env, start)                   # returns at once
    stepper.step(episode_id, env, text, token_ids)          # returns at once
    for outcome in stepper.poll():                          # or stepper.wait(0.05)
        outcome.turn or outcome.failure                     # exactly one of them is set
    stepper.release(episode_id)                             # the episode is over: env.close(), if it has one
    stepper.close_failures()                                # messages of the closes that failed since last asked
    stepper.close()                                         # closes the environments still held, then stops

One asyncio loop in a daemon thread awaits every call: `async def` methods directly, plain ones in a
thread pool of `workers` threads. Each call is bounded by `step_timeout_s`. An environment that
raises, runs past the timeout, or returns something other than what `environment.py` promises
ends its episode with a `Failure` whose reason ("raised", "timeout", "malformed") the caller
counts; it never reaches the caller as an exception. A sync call past its timeout cannot be
stopped: its thread stays busy until the call returns (its result is then dropped), so `workers`
should cover the episodes in flight.

An environment may hold something to give back (a sandbox process, a connection): its optional
`close()` (sync or `async def`) is called once, when its episode is over for whatever reason
(`release`: done, a limit, a failure; `close`: the episodes still in flight when rollout stops),
bounded by `step_timeout_s` too. A close runs in the background and never changes its episode; one
that raises or runs past the timeout is reported by `close_failures`. A sync call cut off (past its
timeout, or running when rollout stops) may still be busy in its thread while the close runs.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import queue
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from stream_rlhf.envs.environment import Environment, EpisodeStart, Observation, Turn

FailureReason = Literal["raised", "timeout", "malformed"]
T = TypeVar("T")


@dataclass(frozen=True)
class Failure:
    reason: FailureReason
    message: str


@dataclass(frozen=True)
class Outcome:
    """The result of one call: `turn` for a step that worked (None after a reset that worked), or
    `failure`; `seconds` is how long the call took (the tool time the pipeline hides)."""

    key: Hashable
    turn: Turn | None
    failure: Failure | None
    seconds: float


class EnvStepper:
    """Runs environment calls concurrently, off the caller's thread; results come back by `poll`."""

    def __init__(self, step_timeout_s: float, workers: int) -> None:
        self.step_timeout_s = step_timeout_s
        self._loop = asyncio.new_event_loop()
        self._executor = ThreadPoolExecutor(workers, thread_name_prefix="env-call")
        self._thread = threading.Thread(target=self._loop.run_forever, name="env-stepper", daemon=True)
        self._thread.start()
        self._results: queue.SimpleQueue[Outcome] = queue.SimpleQueue()
        self._close_failures: queue.SimpleQueue[str] = queue.SimpleQueue()
        self.in_flight = 0
        """Calls submitted and not yet returned by poll/wait."""
        self._envs: dict[Hashable, Environment] = {}
        """The environments reset and not yet released, by key."""
        self._calls: set[asyncio.Task[None]] = set()
        """Resets and steps running (touched on the loop's thread only)."""
        self._closing: list[Future[None]] = []
        """Closes submitted and maybe not over."""

    def reset(self, key: Hashable, env: Environment, start: EpisodeStart) -> None:
        """Call `env.reset(start)` in the background; its `Outcome` (turn None) carries `key`. The
        stepper holds `env` until `release(key)`."""
        self._envs[key] = env
        self._submit(key, env.reset, (start,), _check_reset)

    def step(self, key: Hashable, env: Environment, text: str, token_ids: Sequence[int]) -> None:
        """Call `env.step(text, token_ids)` in the background; its `Outcome` carries `key`."""
        self._submit(key, env.step, (text, token_ids), _check_turn)

    def release(self, key: Hashable) -> None:
        """`key`'s episode is over (no call of it in flight): its environment's `close()`, if it has
        one, runs in the background."""
        env = self._envs.pop(key, None)
        close = getattr(env, "close", None)
        if callable(close):
            self._closing = [future for future in self._closing if not future.done()]
            self._closing.append(asyncio.run_coroutine_threadsafe(self._close_env(close), self._loop))

    def close_failures(self) -> list[str]:
        """A message per environment close that raised or timed out since the last call."""
        return _drain(self._close_failures)

    def _submit(self, key: Hashable, method: Callable[..., Any], args: tuple[Any, ...],
                check: Callable[[Any], str | None]) -> None:
        self.in_flight += 1
        asyncio.run_coroutine_threadsafe(self._call(key, method, args, check), self._loop)

    def poll(self) -> list[Outcome]:
        """The outcomes that have arrived, without waiting."""
        outcomes = _drain(self._results)
        self.in_flight -= len(outcomes)
        return outcomes

    def wait(self, timeout_s: float) -> list[Outcome]:
        """At least one outcome if one arrives within `timeout_s`, plus any others already there."""
        try:
            first = self._results.get(timeout=timeout_s)
        except queue.Empty:
            return []
        self.in_flight -= 1
        return [first, *self.poll()]

    def close(self) -> None:
        """Stop: resets and steps still running are abandoned (their results dropped), the
        environments still held are closed, and every close gets up to `step_timeout_s` to end."""
        asyncio.run_coroutine_threadsafe(self._cancel_calls(), self._loop).result(timeout=5)
        for key in list(self._envs):
            self.release(key)
        wait(self._closing, timeout=self.step_timeout_s + 5)  # each is bounded by step_timeout_s
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        self._loop.close()
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def _cancel_calls(self) -> None:
        calls = list(self._calls)
        for task in calls:
            task.cancel()
        await asyncio.gather(*calls, return_exceptions=True)

    async def _close_env(self, close: Callable[[], Any]) -> None:
        try:
            await asyncio.wait_for(run_call(close, (), self._executor), self.step_timeout_s)
        except asyncio.TimeoutError:
            self._close_failures.put(f"{_name(close)} ran past env.step_timeout_s={self.step_timeout_s}")
        except Exception as exc:  # a failing close is reported, and its episode stays as it ended
            self._close_failures.put(f"{_name(close)} raised {type(exc).__name__}: {exc}")

    async def _call(self, key: Hashable, method: Callable[..., Any], args: tuple[Any, ...],
                    check: Callable[[Any], str | None]) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._calls.add(task)
        try:
            self._results.put(await self._outcome(key, method, args, check))
        finally:
            self._calls.discard(task)

    async def _outcome(self, key: Hashable, method: Callable[..., Any], args: tuple[Any, ...],
                       check: Callable[[Any], str | None]) -> Outcome:
        start = time.monotonic()
        try:
            result = await asyncio.wait_for(run_call(method, args, self._executor), self.step_timeout_s)
        except asyncio.TimeoutError:
            failure = Failure("timeout", f"{_name(method)} ran past env.step_timeout_s={self.step_timeout_s}")
            outcome = Outcome(key, None, failure, time.monotonic() - start)
        except Exception as exc:  # whatever the user's environment raises ends only its episode
            failure = Failure("raised", f"{_name(method)} raised {type(exc).__name__}: {exc}")
            outcome = Outcome(key, None, failure, time.monotonic() - start)
        else:
            problem = check(result)
            failure = Failure("malformed", f"{_name(method)}: {problem}") if problem else None
            turn = result if isinstance(result, Turn) and failure is None else None
            outcome = Outcome(key, turn, failure, time.monotonic() - start)
        return outcome


async def run_call(method: Callable[..., Any], args: tuple[Any, ...], executor: ThreadPoolExecutor) -> Any:
    """`method(*args)` on the running loop: awaited when it is `async def`, else in `executor`'s
    threads (and its result awaited if it is awaitable)."""
    if inspect.iscoroutinefunction(method):
        return await method(*args)
    result = await asyncio.get_running_loop().run_in_executor(executor, method, *args)
    return await result if inspect.isawaitable(result) else result


def _drain(items: queue.SimpleQueue[T]) -> list[T]:
    """What `items` holds now, taken out in order."""
    taken = []
    while True:
        try:
            taken.append(items.get_nowait())
        except queue.Empty:
            return taken


def _name(method: Callable[..., Any]) -> str:
    return getattr(method, "__qualname__", repr(method))


def _check_reset(result: Any) -> str | None:
    return None if result is None else f"reset returned {type(result).__name__}, expected None"


def _check_turn(result: Any) -> str | None:
    """What is wrong with a step's result, or None when it is a well-formed Turn."""
    if not isinstance(result, Turn):
        return f"returned {type(result).__name__} {result!r:.80}, expected envs.environment.Turn"
    for observation in result.observations:
        if not isinstance(observation, Observation) or not isinstance(observation.text, str):
            return (f"observation={observation!r:.80}: expected Observation(text: str, images: tuple[str, ...], "
                    "role: str | None), or a tuple of them")
        if not all(isinstance(image, str) for image in observation.images):
            return f"observation.images={observation.images!r:.80}: expected paths (str)"
        if observation.role is not None and not isinstance(observation.role, str):
            return f"observation.role={observation.role!r:.80}: expected a str or None"
    reward = result.reward
    if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
        return f"reward={result.reward!r}: expected a finite number"
    if not isinstance(result.done, bool):
        return f"done={result.done!r}: expected a bool"
    return None
