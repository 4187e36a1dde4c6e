"""What every child process of a job (the broker, a stage rank, a rollout's vLLM engine) does
first: leave Ctrl-C to its parent and die with it."""

from __future__ import annotations

import ctypes
import signal
import sys

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def child_signals() -> None:
    """For a child process (the broker, a stage, a rollout's vLLM engine): Ctrl-C reaches the
    whole process group; the parent alone handles it and stops its children (the launcher
    through the broker and SIGTERM), so a child never dies half-started. If the parent itself
    dies (even by SIGKILL), Linux sends the child SIGTERM: no orphans."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
