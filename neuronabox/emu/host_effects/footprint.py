"""A CPU library's footprint on the real rank's core: the CPU gloo would spend, spent for real.

Gloo moves bytes with the host's CPU (its worker threads, the kernel's TCP; on an ``nbox up``
cluster also the relay that delays the links, which the calibration measures with the rest).
On the real rank's core that work competes with training: measured here (CNN, 1 Gbit/s,
2-rank DDP), the conv backward that overlaps the gradient all-reduce ran 38.8 ms in the real
system and 30.4 ms emulated. A progress rate can slow the op; only CPU actually spent can slow
the compute. So, in model mode with a calibrated CPU cost
(``nbox calibrate`` writes ``cpu_cost`` into the profile), one thread spends each op's cost
in CPU time on the process's cores, the ops' costs in the order charged, and an op completes
no earlier than its cost is spent. The OS shares the core between it and the training thread
as it shares it with gloo's threads, so both effects come from one measured figure.

The cost is spent as the bytes move, from when the op has the link until its modeled end, not
all at once when it is issued: at 100 Mbit/s a 2 MiB all-reduce costs each rank 23 ms of CPU
over 200 ms, and spent up front that took 23 ms from the backward beside it (model mode +4 to
+6% in every 100 Mbit/s cell) where the real system spreads it over the transfer.

The work is ``memcpy`` through ctypes (which drops the GIL for the call), chunk by chunk,
like a network stack's copies; it runs only while an op has cost left, and sleeps otherwise.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Callable

from ...collectives import Op
from .base import HostEffect, RunContext
from .spin_stall import SpinStall

if TYPE_CHECKING:
    from ..timeline import OpRecord

__all__ = ["Footprint", "cpu_cost_from_profile", "interference"]

CHUNK = 256 << 10  # bytes per memcpy: about 20-60 us, so the thread checks its budget often
QUANTUM = 0.5e-3  # CPU seconds spent per wake-up when paced: a 23 ms cost over 200 ms wakes 46 times


INTERFERENCE_RANGE = (0.25, 4.0)  # beyond this the two measurements disagree too much to scale one by the other


def interference(profile: dict | None) -> float | None:
    """Compute the slowest rank lost beside an op over the host CPU that op's share cost (profile measurements), if both are there.

    The CPU cost is the host's busy time; what the training loses beside an op can be more
    (caches, wake-ups, the relay landing on its core) or less. The busy-progress measurement
    runs compute beside an all-reduce of S bytes, which moves ``rate`` of its bytes meanwhile,
    and counts the compute lost against the same window alone, per rank. The slowest rank sets
    a synchronous job's pace, so its loss counts. Measured at 1 Gbit/s, 2 MiB: 3.5 and 9.2 ms
    lost on the two ranks where the CPU cost said 4.9.
    """
    if not profile:
        return None
    bp, c = profile.get("busy_progress"), profile.get("cpu_cost")
    if not isinstance(bp, dict) or not isinstance(c, dict) or not bp.get("lost_compute_s") or c.get("per_byte_s") is None:
        return None
    spent = float(bp.get("rate", 1.0)) * (float(c.get("per_op_s") or 0.0) + float(c["per_byte_s"]) * float(bp["size"]))
    if spent <= 0:
        return None
    lost = max(bp["lost_compute_s"])
    # Gloo's spin stalls took part of that compute; the model spends them separately (spin_stall).
    stall = SpinStall.from_profile(profile)
    if stall is not None:
        # Its op was issued with the ranks' compute, after a barrier: as after the shortest gap.
        lost = max(0.0, lost - stall.mean(int(bp["size"]), 0.0)[1])
    lo, hi = INTERFERENCE_RANGE
    return min(hi, max(lo, lost / spent))


def cpu_cost_from_profile(profile: dict | None) -> tuple[float, float] | None:
    """(seconds per op, seconds per byte) of CPU per rank for an all-reduce, if the profile has them."""
    if not profile:
        return None
    c = profile.get("cpu_cost")
    if not isinstance(c, dict) or c.get("per_byte_s") is None:
        return None
    return max(0.0, float(c.get("per_op_s") or 0.0)), max(0.0, float(c["per_byte_s"]))


class _Charge:
    __slots__ = ("rec", "hold", "seconds", "begin", "span", "done", "event", "callbacks", "spent", "until")

    def __init__(self, rec: "OpRecord", hold: float, seconds: float, since: float | None = None):
        self.rec = rec
        self.hold = hold  # the op completes no earlier than this much is spent
        self.seconds = seconds  # all of it: the rest only within the op's span
        # The bytes move from when the op has the link until its modeled end (or from ``since``,
        # beside an op still running); its CPU goes with them.
        end = rec.end
        if end is not None and rec.start is not None:
            # A spin stall (spin_stall.py) comes before the bytes move, and its CPU with it.
            self.begin = max(rec.start, end - rec.duration) - rec.stall
            if since is not None:
                self.begin = min(self.begin, since - rec.stall)
            self.span = max(0.0, end - self.begin)
        else:
            self.begin, self.span = 0.0, 0.0
        self.done: float | None = None
        self.spent = 0.0  # CPU seconds spent for it so far
        self.until = 0.0  # the quantum being spent ends at this much spent
        self.event = threading.Event()
        self.callbacks: list[Callable[[float], None]] = []

    def due(self, spent: float) -> float:
        """When ``spent`` (> 0) seconds of this op's CPU are due: as the bytes move (an op without a span: at once)."""
        return self.begin + self.span * min(1.0, spent / self.seconds)


class Footprint(HostEffect):
    """One thread spending the calibrated CPU of each op: costs in the order charged, then surpluses.

    ``scale`` (``interference``) is what the compute measurably loses beside an op over its CPU
    cost. Above 1 the surplus is spent beside the op, paced with its bytes, but never holds it
    up: it stops at the op's modeled end (an op whose CPU is its whole time, at 10 Gbit/s, must
    not end later for it). Stopping it already when DDP's next bucket was charged (gloo runs
    two at once) dropped most of it at 1 Gbit/s: model mode 4-6 % fast again. Below 1 the cost
    itself shrinks.
    """

    name = "footprint"

    def __init__(self, per_op_s: float, per_byte_s: float, clock: Callable[[], float] = time.perf_counter,
                 scale: float = 1.0):
        from ...model.profile import ring_terms  # the ring closed form the calibration fits

        self._ring_terms = ring_terms
        self.per_op_s = per_op_s
        self.per_byte_s = per_byte_s
        self.scale = scale
        self._clock = clock
        self._queue: deque[_Charge] = deque()
        self._charges: dict[int, _Charge] = {}
        self._cond = threading.Condition(threading.Lock())
        self._thread: threading.Thread | None = None
        self._stopped = False
        self.spent = 0.0  # CPU seconds spent so far (a figure for reports and tests)

    @classmethod
    def build(cls, run: RunContext) -> "Footprint | None":
        """With a calibrated CPU cost, for a CPU library whose ops only the model times.

        The busy rate (host coupling) still holds the op back while the compute holds the core
        (measured on the real ranks, with gloo's own CPU in the picture). ``NBOX_FOOTPRINT=0``
        turns the footprint off (a diagnostic switch; ``nbox validate``'s load twin beside a
        wire-mode run, whose stubs and relay spend that CPU themselves).
        """
        if not run.modeled_cpu or os.environ.get("NBOX_FOOTPRINT", "1") == "0":
            return None
        cost = cpu_cost_from_profile(run.profile)
        if cost is None:
            return None
        return cls(*cost, scale=interference(run.profile) or 1.0)

    def on_queued(self, r: "OpRecord", beside: float | None) -> None:
        """Charge the op's cost (and the spin drawn for it, ``r.spin``); it completes no earlier than the cost is spent."""
        r.holds += (self,)
        self.charge(r, self.cost(r.op, r.nbytes, r.group.size), exact=r.spin, since=beside)

    def cpu_spent(self) -> float:
        """The thread's CPU (``cpu_time``): the host coupling does not count it as compute."""
        return self.cpu_time()

    def describe(self) -> str:
        """The calibrated cost and scale."""
        return (f"footprint: each op spends {self.per_op_s * 1e6:.0f} us + {self.per_byte_s * 1e9:.3f} ns/byte of CPU "
                f"on this rank's cores, scaled {self.scale:.2f}")

    def cpu_time(self) -> float:
        """CPU seconds the footprint thread has used so far (0 before it starts)."""
        thread = self._thread
        if thread is None or thread.ident is None:
            return 0.0
        try:
            return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
        except (OSError, AttributeError):  # the thread ended, or no per-thread clocks here
            return self.spent

    def cost(self, op: Op, nbytes: int, n: int) -> float:
        """CPU seconds per rank for ``op`` over ``nbytes`` in a group of ``n``: all-reduce's cost scaled by the bytes each rank moves."""
        if n < 2 or op is Op.BARRIER:
            return self.per_op_s if n >= 2 else 0.0
        f = self._ring_terms(op, n)[1]
        f_ar = self._ring_terms(Op.ALL_REDUCE, n)[1] or 1.0
        return self.per_op_s + self.per_byte_s * nbytes * f / f_ar

    def charge(self, rec: "OpRecord", seconds: float, exact: float = 0.0, since: float | None = None) -> None:
        """Spend ``seconds`` of CPU (times ``scale``) for ``rec`` after the ops charged before it, and ``exact`` more beside it.

        ``exact`` is a measured spin (spin_stall.py), unscaled. Like the surplus of a scale above
        1 it never holds the op up: gloo's spinning thread took the core from the compute while
        the op waited, where this thread only shares the core with it, so holding the op until
        the spin is spent made it twice as long. ``since``: the op runs beside another from then
        on, and its CPU is spent from then, not only once its link time comes.
        """
        c = _Charge(rec, seconds * min(1.0, self.scale), seconds * self.scale + exact, since)
        with self._cond:
            if self._stopped:
                c.done = self._clock()
                c.event.set()
                return
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="nbox-footprint", daemon=True)
                self._thread.start()
                # Like the waker: callbacks complete torch futures; stop before finalization.
                atexit.register(self.stop)
            self._charges[rec.seq] = c
            self._queue.append(c)
            self._cond.notify()

    def done(self, rec: "OpRecord") -> bool:
        """Whether ``rec``'s cost has been spent (an op never charged counts as done)."""
        c = self._charges.get(rec.seq)
        return c is None or c.done is not None

    def wait(self, rec: "OpRecord") -> None:
        """Block until ``rec``'s cost has been spent."""
        c = self._charges.get(rec.seq)
        if c is not None:
            c.event.wait()

    def when_done(self, rec: "OpRecord", callback: Callable[[float], None]) -> None:
        """Run ``callback(time)`` once ``rec``'s cost is spent (now, if it is)."""
        with self._cond:
            c = self._charges.get(rec.seq)
            if c is not None and c.done is None:
                c.callbacks.append(callback)
                return
        callback(self._clock())

    def stop(self, timeout: float = 5.0) -> None:
        """Drop what is still queued (those ops count as done) and end the thread."""
        with self._cond:
            self._stopped = True
            now = self._clock()
            for c in self._queue:
                c.done = now
                c.event.set()
            self._queue.clear()
            self._cond.notify()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def _run(self) -> None:
        src = ctypes.create_string_buffer(CHUNK)
        dst = ctypes.create_string_buffer(CHUNK)
        memcpy = ctypes.memmove  # a ctypes foreign call: the GIL is released while it copies
        thread_time = time.thread_time
        counted = thread_time()
        while True:
            with self._cond:
                while not self._queue and not self._stopped:
                    self._cond.wait()
                if self._stopped:
                    return
                c, ahead = self._next(self._clock())
                if c is None:
                    # Ahead of every op's bytes: sleep until the next quantum is due (a new op or stop wakes it early).
                    self._cond.wait(ahead if ahead != float("inf") else None)
                    continue
            if c.done is None and c.spent >= c.hold:
                self._complete(c)
                continue
            memcpy(dst, src, CHUNK)
            # Everything this thread used since it last counted goes to this op: its loop and
            # wake-ups too (counting the copies alone, it used 2.7 times what it counted).
            now = thread_time()
            c.spent += now - counted
            self.spent += now - counted
            counted = now

    def _next(self, now: float) -> tuple[_Charge | None, float]:
        # Under the lock: the charge to spend a chunk for, or none and how long until one is due.
        # Unmet costs go first, in the order the ops were charged; a surplus or spin (which never
        # holds its op) only when no cost is due. Spending one op's surplus to its end before the
        # next op's cost held DDP's second bucket (0.5 MiB, issued 0.6 ms after the first) until
        # the first's surplus was spent: 10 Gbit/s MLP, the last bucket ended 1.1-1.4 ms after the
        # first in model mode and with it in the real system.
        queue = self._queue
        for c in [c for c in queue if c.done is not None and (c.spent >= c.seconds or now >= c.begin + c.span)]:
            queue.remove(c)
        wake = float("inf")
        for surplus in (False, True):
            for c in queue:
                if (c.done is not None) != surplus:
                    continue
                if not surplus and (c.spent >= c.hold or c.seconds <= 0.0):
                    return c, 0.0  # its cost is spent: complete it
                if c.spent < c.until:
                    return c, 0.0  # the rest of the quantum begun below
                # A quantum is spent from when its first part falls due, so the op's last one ends
                # with the op. Waiting until a quantum's end fell due kept the spending a quantum
                # behind its bytes, and an op whose CPU is its time (10 Gbit/s: 1.4 ms of 1.7) then
                # completed 0.5 ms past its end, and the op beside it later still.
                ahead = c.due(c.spent) - now
                if ahead <= 0.0:
                    c.until = min(c.seconds, c.spent + QUANTUM)
                    return c, 0.0
                wake = min(wake, ahead)
        return None, wake

    def _complete(self, c: _Charge) -> None:
        now = self._clock()
        with self._cond:
            c.done = now
            callbacks, c.callbacks = c.callbacks, []
            self._charges.pop(c.rec.seq, None)  # done: an unknown op counts as done
        if c.rec.end is not None and now > c.rec.end:
            c.rec.end = now
        c.event.set()
        for cb in callbacks:
            try:
                cb(now)
            except Exception:  # noqa: BLE001 - one failing callback must not stop the others
                import traceback

                traceback.print_exc()
