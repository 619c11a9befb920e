"""What an observer reads from a run in progress: the emulator's recorder, as typing.Protocols.

The metrics exporter and the progress file (``neuronabox.metrics``) fold in the real rank's
ops and iteration marks while the script runs. They read them through these interfaces and a
``RunSource`` (a callable that returns the current run, or None before the process emulates
anything) instead of importing the emulator: the emulator publishes its source here when its
module loads (``publish``), and an observer built before that, or in a process that emulates
nothing, reads None. Lists are appended to by other threads: read a length once, then only
below it.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Protocol, Sequence

__all__ = ["OpView", "RecorderView", "RunSource", "RunView", "current_run", "publish"]


class OpView(Protocol):
    """One recorded collective, as the exporter reads it (``neuronabox.emu.timeline.OpRecord``)."""

    op: Any  # a neuronabox.collectives.Op; ``.value`` is its name
    group: Sequence[int]
    algorithm: str
    duration: float  # the modeled seconds
    nbytes: int
    iteration: int
    enqueue: float
    end: float
    wait: float


class RecorderView(Protocol):
    """The ops and iteration marks of one real rank, on the recorder's clock from ``t0``."""

    t0: float
    ops: Sequence[OpView]
    iteration_marks: Sequence[float]


class RunView(Protocol):
    """The current run: its recorder and what labels it (``neuronabox.emu.emulator.Emulator``)."""

    recorder: RecorderView
    topology: Any
    model: Any
    real_rank: int
    world_size: int


RunSource = Callable[[], Optional[RunView]]

_source: RunSource | None = None


def publish(source: RunSource) -> None:
    """Name the callable that returns the current run (the emulator's module does, once)."""
    global _source
    _source = source


def current_run() -> RunView | None:
    """The current run, or None when nothing has been emulated in this process."""
    return _source() if _source is not None else None
