"""The ``Work`` a wire-mode collective returns: complete when the wire thread has moved its bytes.

Built on first use (``make_work_class``) so that this module, like the rest of the wire client,
imports torch only when wire mode runs. It carries what the backend's coalescing group reads
from the works it joins, and hands failures to DDP as a future's clean exception.
"""

from __future__ import annotations

import threading

__all__ = ["make_work_class"]


def make_work_class():
    """The ``WireWork`` class (a ``torch.distributed.Work``), made when torch is imported."""
    import torch
    import torch.distributed as dist

    class WireWork(dist.Work):
        """A collective whose bytes cross the wire: complete when the wire thread says so."""

        def __init__(self, rec, result):
            super().__init__()
            self.rec = rec
            self._result = result
            self._done = threading.Event()
            # What the backend's coalescing group (work.GroupWork) reads from the works it joins.
            self._rec, self._event, self._device = rec, None, None
            self._future = self._chained = None
            self._error: BaseException | None = None
            self._lock = threading.Lock()

        def _finish(self, error: BaseException | None = None) -> None:
            with self._lock:
                self._error = error
                self._done.set()
                fut = self._future
            if fut is not None:
                fut.set_result(None)  # the chained future returns the result or raises the error

        def wait(self, timeout=None) -> bool:
            """Block until the real transfer is over."""
            from .timeline import clock

            t = clock()
            limit = timeout.total_seconds() if timeout else None
            if not self._done.wait(limit or None):
                raise RuntimeError(f"nbox wire: {self.rec.op.value} timed out after {limit:.3f}s")
            self.rec.wait += clock() - t
            if self._error is not None:
                raise RuntimeError(f"nbox wire: {self.rec.op.value} failed: {self._error}")
            return True

        def synchronize(self) -> None:
            """Like ``wait``."""
            self.wait()

        def block_current_stream(self) -> None:
            """CPU only: wait."""
            self.wait()

        def is_completed(self) -> bool:
            """Whether the transfer is over."""
            return self._done.is_set()

        def is_success(self) -> bool:
            """Whether it completed without error."""
            return self._done.is_set() and self._error is None

        def exception(self):
            """The error, if it failed."""
            return self._error

        def result(self):
            """The output tensors."""
            return self._result

        def source_rank(self) -> int:
            """Not a recv."""
            return -1

        def get_future(self) -> torch.futures.Future:
            """A future completed by the wire thread with the output tensors."""
            with self._lock:
                if self._chained is None:
                    # DDP's reducer crashes (torch 2.13) on a future failed with set_exception from
                    # Python; an error raised in a then-callback reaches it as a clean exception.
                    self._future = torch.futures.Future()
                    self._chained = self._future.then(self._outcome)
                    if self._done.is_set():
                        self._future.set_result(None)
                return self._chained

        def _outcome(self, _base):
            if self._error is not None:
                raise RuntimeError(f"nbox wire: {self.rec.op.value} failed: {self._error}") from self._error
            return self._result

    return WireWork
