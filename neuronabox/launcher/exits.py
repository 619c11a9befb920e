"""How a child process's end reads in nbox's messages: one clause, for the runner, the elastic agent and the profiler."""

from __future__ import annotations

import signal

__all__ = ["describe_exit"]


def describe_exit(code: int) -> str:
    """A process's end as a clause: ``exited with status 3``, ``was killed by SIGTERM``."""
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"
