"""A reward process (`reward.workers`, `reward_pool.py`), run as
`python -m stream_rlhf.rl.reward_worker FD` on one end of a socket pair: it imports the reward
functions and scores one sample at a time for the reward stage.

    first     {kind: dotted path} (`worker_process.start_worker`)              parent -> worker
    ready     (READY, True, None) | (READY, False, message)                     worker -> parent
    request   (index, kind, prompt, response or steps, reference, extra keywords)  parent -> worker
    reply     (index, True, score) | (index, False, message)                    worker -> parent

A score is the OUTCOME function's result as a finite float, or the STEPS function's as a list of
finite floats; whatever a function raises, or a result not of its kind, comes back as a message
naming it. The process ends when the parent closes its end of the socket, kills it (a call past
`reward.timeout_s`), or dies (`worker_process.py`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from stream_rlhf.config import import_dotted
from stream_rlhf.rl.reward_pool import CONFIG_KEYS, OUTCOME, Kind, Score
from stream_rlhf.worker_process import READY, worker_connection


def checked(kind: Kind, result: Any) -> Score:
    """`result` as its kind's score; ValueError saying what it was instead."""
    expected = "a finite number" if kind == OUTCOME else "a list of finite numbers"
    try:
        if kind != OUTCOME and isinstance(result, str | bytes):  # iterable, but no list of scores
            raise TypeError
        score: Score = float(result) if kind == OUTCOME else [float(value) for value in result]
    except (TypeError, ValueError):
        raise ValueError(f"returned {result!r:.80}, expected {expected}") from None
    if not all(math.isfinite(value) for value in (score if isinstance(score, list) else [score])):
        raise ValueError(f"returned {score}, expected {expected}")
    return score


def serve(conn: Connection, paths: dict[Kind, str]) -> None:
    """Score `conn`'s requests with the functions at `paths` until the parent closes it."""
    functions: dict[Kind, Callable[..., Any]] = {}
    try:
        for kind, path in paths.items():
            functions[kind] = import_dotted(path, CONFIG_KEYS[kind])
    except Exception as exc:
        conn.send((READY, False, f"{type(exc).__name__}: {exc}"))
        return
    conn.send((READY, True, None))
    while True:
        try:
            index, kind, prompt, answer, reference, kwargs = conn.recv()
        except (EOFError, OSError):
            return
        try:
            result = functions[kind](prompt, answer, reference, **kwargs)
        except Exception as exc:  # the function's error goes back to the stage, which names the sample
            conn.send((index, False, f"{paths[kind]} raised {type(exc).__name__}: {exc}"))
            continue
        try:
            conn.send((index, True, checked(kind, result)))
        except ValueError as exc:
            conn.send((index, False, f"{paths[kind]} {exc}"))


if __name__ == "__main__":
    serve(*worker_connection())
