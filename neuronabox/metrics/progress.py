"""Live progress of a run: iterations done and iteration time so far.

Two halves, because ``nbox run`` is two processes. In the real rank, ``ProgressWriter`` is a
daemon thread that looks at the Recorder twice a second and, when iterations were added,
rewrites a small JSON file (``NBOX_PROGRESS_FILE``); the training thread does no extra work.
In ``nbox run``, ``RunProgress`` polls that file and shows a rich progress line:

    ⠙ iteration 412 · last 21.1 ms · median 21.3 ms · p95 25.0 ms · 0:00:09

``SweepProgress`` is the same line for a known number of runs (what-if sweeps, benchmarks).
"""

from __future__ import annotations

import bisect
import contextlib
import json
import os
import threading
import time
from pathlib import Path

from ..recording import RunSource, current_run
from ..runfiles import owned_tempdir
from ..units import format_duration

__all__ = ["ENV_PROGRESS", "ProgressWriter", "RunProgress", "SweepProgress", "read_progress"]

ENV_PROGRESS = "NBOX_PROGRESS_FILE"


class ProgressWriter:
    """Writes the real rank's iteration count and times to ``path`` every ``interval`` seconds (when they change)."""

    def __init__(
        self, path: str | os.PathLike, interval: float = 0.5, emulator_source: RunSource = current_run
    ):
        self.path = str(path)
        self.interval = interval
        self._source = emulator_source
        self._stop = threading.Event()
        self._recorder = None
        self._cursor = 0
        self._sorted: list[float] = []  # iteration times after the first, kept sorted for the median and p95
        self._first: float | None = None
        self._last = None
        self._started = time.time()
        self._thread = threading.Thread(target=self._run, name="nbox-progress", daemon=True)

    def start(self) -> "ProgressWriter":
        """Start the thread; returns self."""
        self._thread.start()
        return self

    def stop(self) -> None:
        """Write a last time and stop."""
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=2)
        self.poll()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.poll()
            except Exception:  # noqa: BLE001 - progress is a nicety; never disturb the run
                pass

    def poll(self) -> bool:
        """Fold new iterations in and rewrite the file if there were any; returns whether it wrote."""
        emu = self._source()
        rec = getattr(emu, "recorder", None)
        if rec is None:
            return False
        if rec is not self._recorder:
            self._recorder, self._cursor, self._sorted, self._first = rec, 0, [], None
        marks = rec.iteration_marks
        n = len(marks)
        if n == self._cursor:
            return False
        for i in range(self._cursor, n):
            d = marks[i] - (marks[i - 1] if i else rec.t0)
            if i:
                bisect.insort(self._sorted, d)
            else:
                self._first = d
            self._last = d
        self._cursor = n
        # The first iteration carries set-up (allocations, DDP buckets): it counts only while alone.
        body = self._sorted or [self._first]
        state = {
            "pid": os.getpid(),
            "iterations": n,
            "last_s": self._last,
            "median_s": body[len(body) // 2],
            "p95_s": body[min(len(body) - 1, int(round(0.95 * (len(body) - 1))))],
            "elapsed_s": time.time() - self._started,
            "world_size": getattr(emu, "world_size", None),
        }
        tmp = f"{self.path}.{os.getpid()}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(state, f)
        os.replace(tmp, self.path)
        return True


def read_progress(path: str | os.PathLike) -> dict | None:
    """The last state a ProgressWriter wrote, or None."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (FileNotFoundError, json.JSONDecodeError, OSError):
        return None


def _line(state: dict | None) -> str:
    if not state:
        return "waiting for the first iteration"
    return (
        f"iteration {state['iterations']} · last {format_duration(state['last_s'])} · "
        f"median {format_duration(state['median_s'])} · p95 {format_duration(state['p95_s'])}"
    )


class RunProgress:
    """A rich progress line in ``nbox run`` fed by the real rank's ProgressWriter; a context manager.

    ``with RunProgress(console): run_command(...)``: while enabled (a terminal, by default) it
    sets ``NBOX_PROGRESS_FILE`` in ``os.environ``, which the child inherits. ``total``
    (iterations, when known) turns the spinner into a bar.
    """

    def __init__(self, console=None, *, total: int | None = None, interval: float = 0.25, set_env: bool | None = None,
                 enabled: bool | None = None):
        from rich.console import Console

        self.console = console or Console(stderr=True)
        self.total = total
        self.interval = interval
        # A progress line only helps on a terminal; in logs and pipes it is noise.
        self.enabled = self.console.is_terminal if enabled is None else enabled
        # Without a line to show, the real rank need not write its progress file either.
        self.set_env = self.enabled if set_env is None else set_env
        # Owned (runfiles.py): the folder of a kill -9'd run is removed when the next one starts.
        self._folder = contextlib.ExitStack()
        self.path = str(Path(self._folder.enter_context(owned_tempdir("nbox-progress-"))) / "progress.json")
        self.env = {ENV_PROGRESS: self.path}
        self._saved: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._progress = None
        self._task = None
        self.last: dict | None = None

    def __enter__(self) -> "RunProgress":
        if self.set_env:
            self._saved = os.environ.get(ENV_PROGRESS)
            os.environ[ENV_PROGRESS] = self.path
        if self.enabled:
            from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

            cols = [SpinnerColumn(), TextColumn("{task.description}")]
            if self.total:
                cols.append(BarColumn())
            cols.append(TimeElapsedColumn())
            self._progress = Progress(*cols, console=self.console, transient=True)
            self._progress.start()
            self._task = self._progress.add_task(_line(None), total=self.total)
            self._thread = threading.Thread(target=self._poll, name="nbox-progress-view", daemon=True)
            self._thread.start()
        return self

    def _poll(self) -> None:
        while not self._stop.wait(self.interval):
            self.refresh()

    def refresh(self) -> dict | None:
        """Read the file once and update the line; returns the state read."""
        state = read_progress(self.path)
        if state is not None:
            self.last = state
        if self._progress is not None:
            done = (self.last or {}).get("iterations", 0)
            self._progress.update(self._task, description=_line(self.last), completed=done)
        return self.last

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
        self.refresh()
        if self._progress is not None:
            self._progress.stop()
        if self.set_env:
            if self._saved is None:
                os.environ.pop(ENV_PROGRESS, None)
            else:
                os.environ[ENV_PROGRESS] = self._saved
        self._folder.close()


class SweepProgress:
    """A progress bar over a known number of runs, showing the last run's iteration time."""

    def __init__(self, total: int, description: str = "sweep", console=None, enabled: bool | None = None):
        from rich.console import Console

        self.console = console or Console(stderr=True)
        self.total = total
        self.description = description
        self.enabled = self.console.is_terminal if enabled is None else enabled
        self._progress = None
        self._task = None
        self.done = 0

    def __enter__(self) -> "SweepProgress":
        if self.enabled:
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )

            self._progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                      TimeElapsedColumn(), TimeRemainingColumn(), console=self.console, transient=True)
            self._progress.start()
            self._task = self._progress.add_task(self.description, total=self.total)
        return self

    def advance(self, label: str = "", iteration_s: float | None = None) -> None:
        """One run finished: ``label`` names it, ``iteration_s`` is its median iteration time."""
        self.done += 1
        if self._progress is not None:
            text = self.description
            if label:
                text += f" · {label}"
            if iteration_s is not None:
                text += f" · {format_duration(iteration_s)}/iteration"
            self._progress.update(self._task, advance=1, description=text)

    def __exit__(self, *exc) -> None:
        if self._progress is not None:
            self._progress.stop()
