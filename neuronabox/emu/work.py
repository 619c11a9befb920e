"""The handles of emulated ops (``torch.distributed.Work``): when each one completes, and how a caller learns it.

CPU tensors: ``wait()`` sleeps in the calling thread until the op's modeled end (no thread
polls); a host effect may make that end tentative (host coupling: the timeline settles it
again after the sleep) or hold the op past it (the footprint, until its CPU is spent:
``OpRecord.holds``). A future, when someone asks for one (DDP's reducer does), is completed
by the emulator's single ``Waker`` thread at the end. CUDA tensors: ``wait()`` makes the
caller's stream wait on an event recorded after the device-side timed wait; the CPU never
blocks. A replayed op (shared with a rank of another role, replay.py) learns its end only
from the real rank's later calls, or is forced when none comes.
"""

from __future__ import annotations

import datetime
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from ..collectives import Op
from .timeline import OpRecord, Timeline, clock, sleep_until, tune_thread_timer_slack

if TYPE_CHECKING:
    from .emulator import Emulator

__all__ = ["NboxWork", "ReplayedWork", "GroupWork", "done_work", "FORCE_AFTER_S"]

# A replayed op that a future waits on, unresolved while the real rank made no call this long, is
# taken to have all its ranks there (replay.py's forced resolution).
FORCE_AFTER_S = 2.0


class NboxWork(dist.Work):
    """An emulated op's handle: complete at the modeled finish time."""

    def __init__(
        self,
        record: OpRecord,
        result,
        emulator: Emulator,
        event=None,
        device: torch.device | None = None,
        source_rank: int = -1,
    ):
        super().__init__()
        self._rec = record
        self._result = result
        self._emu = emulator
        self._event = event  # CUDA path: recorded on the comm stream after the op
        self._device = device
        self._future = None
        self._done = False
        self._source = source_rank

    @property
    def record(self) -> OpRecord:
        """The timeline record of this op."""
        return self._rec

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        """CPU: sleep until the modeled finish. CUDA: make the current stream wait (the CPU does not block)."""
        if self._event is not None:
            torch.cuda.current_stream(self._device).wait_event(self._event)
            return True
        roles = self._emu.role_recorder
        if roles is not None:  # a profiling run: the wait is not the role's compute
            roles.wait_begins(self._rec)
            try:
                return self._wait(timeout)
            finally:
                roles.wait_ends()
        return self._wait(timeout)

    def _wait(self, timeout: datetime.timedelta | None) -> bool:
        if self._done:
            return True
        rec = self._rec
        now = clock()
        coupled = rec.coupled
        if now < rec.end or (coupled is not None and not coupled.settle(rec)):
            limit = timeout.total_seconds() if timeout else 0.0
            tune_thread_timer_slack()
            while True:
                if limit > 0 and rec.end - now > limit:
                    sleep_until(now + limit)
                    rec.wait += clock() - now
                    raise RuntimeError(
                        f"nbox: {rec.op.value} on {rec.comm} timed out after {limit:.3f}s "
                        f"(it finishes {rec.end - now:.3f}s after the wait began)"
                    )
                sleep_until(rec.end)
                # A host-coupled op's end assumed an idle host; while we slept it was, so one
                # more settle normally finds it done (other threads may have computed meanwhile).
                if coupled is None or coupled.settle(rec):
                    break
            after = clock()
            rec.wait += after - now
            if rec.completed is None:
                rec.completed = after
        for hold in rec.holds:
            if not hold.done(rec):
                t = clock()
                hold.wait(rec)  # the footprint: the op's CPU is not spent yet, the core was busy with compute
                after = clock()
                rec.wait += after - t
                rec.completed = after
        self._done = True
        return True

    def synchronize(self) -> None:
        """Like ``wait``."""
        self.wait()

    def block_current_stream(self) -> None:
        """Make the current stream wait for this op (CPU: wait)."""
        self.wait()

    def is_completed(self) -> bool:
        """Whether the modeled finish time has passed (CUDA: whether the device got there)."""
        if self._event is not None:
            return self._event.query()
        return self._done or _over(self._rec)

    def is_success(self) -> bool:
        """Emulated ops never fail."""
        return True

    def exception(self):
        """No exception: emulated ops never fail."""
        return None

    def result(self):
        """The output tensors."""
        return self._result

    def source_rank(self) -> int:
        """The peer a ``recv_anysource`` received from."""
        return self._source

    def get_future(self) -> torch.futures.Future:
        """A future that completes at the finish time with the output tensors."""
        if self._future is not None:
            return self._future
        if self._event is not None:
            self._future = _cuda_future(self._event, self._device, self._result)
            return self._future
        fut = torch.futures.Future()
        self._future = fut
        rec, result = self._rec, self._result
        coupled, holds, waker = rec.coupled, rec.holds, self._emu.waker
        if _over(rec):
            fut.set_result(result)
        else:

            def complete(now: float) -> None:
                if coupled is not None and not coupled.settle(rec):
                    waker.at(rec.end, complete)  # the host computed meanwhile: the end moved
                    return
                for hold in holds:
                    if not hold.done(rec):
                        hold.when_done(rec, complete)  # the footprint: its CPU is not spent yet
                        return
                if rec.completed is None:
                    rec.completed = now
                fut.set_result(result)

            waker.at(rec.end, complete)
        return fut


def _over(rec: OpRecord) -> bool:
    """Whether a host-timed op has finished now: its modeled end passed, its progress (host coupling) and its CPU (footprint) done."""
    for hold in rec.holds:
        if not hold.done(rec):
            return False
    return clock() >= rec.end and (rec.coupled is None or rec.coupled.settle(rec))


def _cuda_future(event, device: torch.device, result) -> torch.futures.Future:
    # A CUDA-aware future records events on the current streams at set_result; run that on a side
    # stream that waits for this op only (the comm stream may already hold later ops).
    side = torch.cuda.Stream(device=device)
    side.wait_event(event)
    fut = torch.futures.Future(devices=[device])
    with torch.cuda.device(device), torch.cuda.stream(side):
        fut.set_result(result)
    return fut


class ReplayedWork(NboxWork):
    """An op shared with a replayed rank of another role (replay.py): its end may be known only after later calls."""

    def __init__(self, record: OpRecord, result, emulator: Emulator, instance, source_rank: int = -1, into=()):
        super().__init__(record, result, emulator, source_rank=source_rank)
        self._inst = instance
        self._into = into  # a receive: the sender's recorded values, where its profile kept them

    def _deliver(self) -> None:
        payload = self._inst.payload
        if payload is None or len(self._into) != 1:
            return
        t = self._into[0]
        dtype, values = payload
        if len(values) == t.numel() and str(t.dtype).removeprefix("torch.") == dtype:
            with torch.no_grad():
                t.copy_(torch.tensor(values, dtype=t.dtype).reshape(t.shape))
        self._into = ()

    def _wait(self, timeout: datetime.timedelta | None) -> bool:
        if self._done:
            return True
        # The real rank makes no further call while it waits: whatever the op needs is known now.
        self._emu.replay.settle(self._inst, force=True)
        self._deliver()
        rec = self._rec
        now = clock()
        if now < rec.end:
            tune_thread_timer_slack()
            sleep_until(rec.end)
            after = clock()
            rec.wait += after - now
            rec.completed = after
        elif rec.completed is None:
            rec.completed = now
        self._done = True
        return True

    def is_completed(self) -> bool:
        """Whether the op's end is known and has passed."""
        return self._done or (self._emu.replay.settle(self._inst, force=False) and clock() >= self._rec.end)

    def get_future(self) -> torch.futures.Future:
        """A future completed at the op's end, once a later call of the real rank has fixed it."""
        if self._future is None:
            fut = self._future = torch.futures.Future()
            rec, result, waker = self._rec, self._result, self._emu.waker

            def complete(now: float) -> None:
                if rec.completed is None:
                    rec.completed = now
                self._deliver()
                fut.set_result(result)

            replay, inst = self._emu.replay, self._inst
            replay.when_resolved(inst, lambda end: waker.at(end, complete))
            if inst.end is None:
                # Torch may wait on this future from C++ (DDP's reducer), where no Python call of
                # the real rank can come to resolve it: if none has come for a while, force it.
                calls = replay.real_calls

                def stalled(now: float) -> None:
                    if inst.end is None:
                        if replay.real_calls == calls:
                            replay.settle(inst, force=True)
                        else:
                            waker.at(now + FORCE_AFTER_S, stalled)

                waker.at(clock() + FORCE_AFTER_S, stalled)
        return self._future


class GroupWork(NboxWork):
    """The works issued between ``start_coalescing`` and ``end_coalescing``: done when all are."""

    def __init__(self, works: list[NboxWork], emulator: Emulator):
        # Hybrid works (hybrid.py) complete when their real part is done too; device-timed ones learn their end later.
        self._hybrid = any(hasattr(w, "hybrid") or isinstance(w, ReplayedWork) for w in works)
        if self._hybrid or any(w._event is not None for w in works):
            last = works[-1]  # device-timed: the last one issued (same stream, FIFO) ends last
        else:
            last = max(works, key=lambda w: w._rec.end)
        super().__init__(last._rec, [w._result for w in works], emulator, last._event, last._device)
        self._works = works

    def get_future(self) -> torch.futures.Future:
        """A future that completes when every op of the group has."""
        if not self._hybrid:
            return super().get_future()
        if self._future is None:
            results = self._result

            def all_done(fut):
                for f in fut.value():
                    f.value()  # raises the first failure
                return results

            self._future = torch.futures.collect_all([w.get_future() for w in self._works]).then(all_done)
        return self._future

    def is_success(self) -> bool:
        """Whether every op of the group succeeded."""
        return all(w.is_success() for w in self._works)

    def exception(self):
        """The first op's failure, if any."""
        return next((e for w in self._works if (e := w.exception()) is not None), None)

    def wait(self, timeout=None) -> bool:
        """Wait for every op of the group."""
        for w in self._works:
            w.wait(timeout)
        return True

    def is_completed(self) -> bool:
        """Whether every op of the group completed."""
        return all(w.is_completed() for w in self._works)


def done_work(emu: Emulator, timeline: Timeline) -> NboxWork:
    """A work that is already complete (``end_coalescing`` with nothing issued)."""
    now = clock()
    rec = OpRecord(-1, timeline.name, Op.BARRIER, timeline.group, 0, 0, "none", emu.recorder.iteration, now, 0.0, 0.0)
    rec.ready = rec.start = rec.end = now
    work = NboxWork(rec, [], emu)
    work._done = True
    return work
