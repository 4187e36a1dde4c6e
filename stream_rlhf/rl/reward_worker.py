"""A reward process (`reward.workers`, `reward_pool.py`), run as
`python -m stream_rlhf.rl.reward_worker FD` on one end of a socket pair: it imports the reward
function and scores one sample at a time for the reward stage.

    first     the function's dotted path (`worker_process.start_worker`)   parent -> worker
    ready     (READY, True, None) | (READY, False, message)             worker -> parent
    request   (index, prompt, response, reference, extra keywords)      parent -> worker
    reply     (index, True, score) | (index, False, message)            worker -> parent

A score is the function's result as a finite float; whatever the function raises, or a result
that is not a finite number, comes back as a message naming it. The process ends when the parent
closes its end of the socket, kills it (a call past `reward.timeout_s`), or dies
(`worker_process.py`).
"""

from __future__ import annotations

import math
from multiprocessing.connection import Connection

from stream_rlhf.config import import_dotted
from stream_rlhf.worker_process import READY, worker_connection


def serve(conn: Connection, path: str) -> None:
    """Score `conn`'s requests with the function at `path` until the parent closes it."""
    try:
        function = import_dotted(path, "reward.function")
    except Exception as exc:
        conn.send((READY, False, f"{type(exc).__name__}: {exc}"))
        return
    conn.send((READY, True, None))
    while True:
        try:
            index, prompt, response, reference, kwargs = conn.recv()
        except (EOFError, OSError):
            return
        try:
            score = float(function(prompt, response, reference, **kwargs))
        except Exception as exc:  # the function's error goes back to the stage, which names the sample
            conn.send((index, False, f"{path} raised {type(exc).__name__}: {exc}"))
            continue
        if not math.isfinite(score):
            conn.send((index, False, f"{path} returned {score}, expected a finite number"))
            continue
        conn.send((index, True, score))


if __name__ == "__main__":
    serve(*worker_connection())
