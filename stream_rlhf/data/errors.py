"""The error a bad dataset line raises; its own module so the CLI can catch it without importing
the data loaders (torch, PIL)."""

from __future__ import annotations


class DataError(ValueError):
    """A bad line (source "file:line") or a file with no usable line (source "file")."""

    def __init__(self, source: str, kind: str, reason: str) -> None:
        super().__init__(f"{source}: {reason}")
        self.source, self.kind, self.reason = source, kind, reason

    def __reduce__(self):  # picklable across processes despite the custom __init__
        return type(self), (self.source, self.kind, self.reason)
