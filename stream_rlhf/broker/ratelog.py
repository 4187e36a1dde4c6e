"""Logging what peers do wrong without letting them flood the log: one line per cause per window.

A broken or hostile peer can send thousands of bad frames a second. Each one is counted by the
caller; this logs the first of each cause in a window of `window_s` seconds and, once the window
is over, one line for the rest:

    rejected message from b'fuzz': malformed message: ...
    ... and 9,999 more like it (malformed) in the last 10 s

Text a peer supplied (stage names, topics, reasons, routing ids) is cut to `max_chars` first.
The broker and the payload server each log their rejections through one of these.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

MAX_CHARS = 200
"""Echoed peer text beyond this many characters is cut (with its full length said)."""


def truncate(value: object, max_chars: int = MAX_CHARS) -> object:
    """`value` with a str or bytes longer than `max_chars` cut short; anything else unchanged."""
    if isinstance(value, (str, bytes)) and len(value) > max_chars:
        return value[:max_chars] + (f"... ({len(value):,} chars)" if isinstance(value, str) else b"...")
    return value


@dataclass
class _Window:
    started: float
    suppressed: int = 0


class RateLimitedLog:
    def __init__(self, logger: logging.Logger | logging.LoggerAdapter, window_s: float = 10.0,
                 max_chars: int = MAX_CHARS, clock: Callable[[], float] = time.monotonic):
        self.logger = logger
        self.window_s = window_s
        self.max_chars = max_chars
        self._clock = clock
        self._windows: dict[str, _Window] = {}  # by cause: a fixed set of names from our code

    def log(self, level: int, cause: str, fmt: str, *args: object, exc_info: BaseException | None = None) -> None:
        """Log `fmt % args` (str/bytes args truncated) unless `cause` was logged in this window."""
        now = self._clock()
        window = self._windows.get(cause)
        if window is not None and now - window.started < self.window_s:
            window.suppressed += 1
            return
        if window is not None:
            self._summarise(cause, window)
        self._windows[cause] = _Window(now)
        self.logger.log(level, fmt, *(truncate(a, self.max_chars) for a in args), exc_info=exc_info)

    def flush(self) -> None:
        """Say how many lines were held back in every window that has ended (call it now and then)."""
        now = self._clock()
        for cause, window in list(self._windows.items()):
            if now - window.started >= self.window_s:
                self._summarise(cause, window)
                del self._windows[cause]

    def _summarise(self, cause: str, window: _Window) -> None:
        if window.suppressed:
            self.logger.warning("... and %s more like it (%s) in the last %g s", f"{window.suppressed:,}", cause,
                                self.window_s)
