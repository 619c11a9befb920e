"""CPU-driven collectives: an op moves slower while its rank's host computes.

A CPU library (gloo over TCP) needs the host's CPU to make progress: its threads copy,
reduce and push bytes through the kernel (and, in an ``nbox up`` cluster, through the delay
relay). While the training thread holds the core (backward), a gradient all-reduce launched
early crawls and finishes only once the core is free; measured on the 2-core machine at
10 Gbit/s, DDP's all-reduce was almost fully hidden in model mode and 10-13 ms exposed in
the real system. NCCL on a GPU does not share the host core, so there the rate is 1.

The rule: an op needs ``duration`` seconds of progress (its modeled time on an idle host).
It progresses at rate 1 while the process is idle and at rate ``busy_rate`` while it
computes, judged by the process's CPU time (less what the footprint thread spent for the
ops, footprint.py): over an interval where the process used ``c`` CPU-seconds of ``dt`` wall seconds, the rate is ``1 - min(1, c/dt)·(1 - busy_rate)``.
Except at first: an op makes no progress over its first ``stall`` seconds of the host's compute
(rate ``1 - c/dt``), then moves at ``busy_rate``. Gloo's threads wait for the core the training
thread holds until the scheduler hands it over; once the bytes stream, the kernel's socket
buffers carry them between the threads' turns. Measured at 300 Mbit/s (a 1.1 or 2.1 MB
all-reduce, matrix products beside it for 2.5 to 40 ms): 1.3-2.8 ms lost after 2.5 ms of
compute, 2.5-6.7 ms after 5 to 40; a rate alone, fitted over the whole op, charged 0.2 ms and
5 ms, and left the three DDP workloads 1-5 % fast (the MLP's first bucket meets 1 ms of its
backward, the transformer's 10, the CNN's 30).
``nbox calibrate`` measures both on the real ranks (profile field ``busy_progress``: ``rate``
over a whole op, and ``stall_s`` with ``rate_after_stall`` fitted over compute windows from a
32nd of the op to all of it; a profile without them has no stall).

No thread polls: the timeline settles progress when an op is issued and when a tentative end
is reached (an end assumes an idle host from the last settle on, so it is never late; if the
host computed meanwhile, the end moves later and the waiter sleeps again). The accounting is
exact in total because progress is linear in CPU time over an interval.
"""

from __future__ import annotations

import time
from collections import deque
from typing import TYPE_CHECKING, Callable

from .base import HostEffect, RunContext

if TYPE_CHECKING:
    from ..timeline import OpRecord

__all__ = ["HostCoupling", "busy_rate_from_profile", "busy_stall_from_profile", "MIN_RATE"]

# A floor: with rate 0 an op issued during a long compute phase would need one settle per
# tentative end until the phase ends; 2% keeps the count bounded and is below what was measured.
MIN_RATE = 0.02
# Progress short of the need by less than this counts as done: the waiting thread's own wake-up
# CPU would otherwise leave a few microseconds and cost another sleep.
EPS = 20e-6


def busy_rate_from_profile(profile: dict | None) -> float | None:
    """The calibrated progress rate under compute (``busy_progress.rate``), if the profile has one."""
    if not profile:
        return None
    bp = profile.get("busy_progress")
    if not isinstance(bp, dict) or bp.get("rate") is None:
        return None
    rate = bp.get("rate_after_stall") if bp.get("stall_s") is not None else None
    return max(MIN_RATE, min(1.0, float(bp["rate"] if rate is None else rate)))


def busy_stall_from_profile(profile: dict | None) -> float:
    """Seconds of the host's compute over which an op makes no progress at first (``busy_progress.stall_s``; 0 without)."""
    bp = (profile or {}).get("busy_progress")
    if not isinstance(bp, dict) or bp.get("stall_s") is None:
        return 0.0
    return max(0.0, float(bp["stall_s"]))


class HostCoupling(HostEffect):
    """Per-communicator progress accounting of host-timed ops (FIFO, like the timeline).

    The run builds one from the profile (a CPU library the model alone times, a busy rate below
    1); each communicator gets its own accounting of it (``for_timeline``), on the process's
    compute CPU (its CPU less what other effects spent, such as the footprint's thread).
    """

    name = "host coupling"

    def __init__(self, busy_rate: float, cpu_clock: Callable[[], float] = time.process_time, stall: float = 0.0):
        self.busy_rate = max(MIN_RATE, min(1.0, busy_rate))
        self.stall = max(0.0, stall)
        self._cpu = cpu_clock
        self._stalled: dict[int, float] = {}  # seq -> compute seconds of its stall still ahead
        self.pending: deque[OpRecord] = deque()
        self._left: dict[int, float] = {}  # seq -> seconds of idle-host progress still needed
        self._need: dict[int, float] = {}  # seq -> seconds of progress it needed when admitted
        self._mark_t: float | None = None
        self._mark_cpu = 0.0

    @classmethod
    def build(cls, run: RunContext) -> "HostCoupling | None":
        """With a calibrated busy rate below 1, for a CPU library only the model times (wire, hybrid: real CPU)."""
        rate = busy_rate_from_profile(run.profile)
        stall = busy_stall_from_profile(run.profile)
        if rate is None or (rate >= 1.0 and stall <= 0.0) or not run.modeled_cpu:
            return None
        return cls(rate, run.compute_cpu, stall)

    def for_timeline(self) -> "HostCoupling":
        """A fresh accounting for a new communicator, on the same CPU clock."""
        return HostCoupling(self.busy_rate, self._cpu, self.stall)

    def describe(self) -> str:
        """The calibrated rate (and stall)."""
        first = f"none over its first {self.stall * 1e3:.1f} ms of compute, then " if self.stall > 0 else ""
        return f"host coupling: an op progresses {first}at {self.busy_rate:.2f} of its rate while the host computes"

    def admit(self, r: "OpRecord", prev_end: float, work: float | None = None) -> float:
        """Queue ``r`` behind the op ending at ``prev_end``; it needs ``work`` (default its duration) of progress; returns its end."""
        r.start = max(r.start, prev_end)
        left = r.duration if work is None else work
        r.end = r.start + left
        self.pending.append(r)
        self._left[r.seq] = left
        self._need[r.seq] = left
        if self.stall > 0:
            self._stalled[r.seq] = self.stall
        return r.end

    def lost(self, r: "OpRecord") -> float:
        """Seconds the pending op ``r`` has fallen behind an idle host so far (as of the last settle); 0 once done."""
        left = self._left.get(r.seq)
        if left is None or r.end is None or r.start is None:
            return 0.0
        # After a settle the head's tentative end is now + left: its wall time so far less the progress made.
        return max(0.0, (r.end - r.start) - self._need[r.seq])

    def settle(self, now: float) -> float:
        """Account progress up to ``now``; fix or move the ends of pending ops; returns the last end."""
        cpu = self._cpu()
        if self._mark_t is None or now <= self._mark_t:
            if self._mark_t is None:
                self._mark_t, self._mark_cpu = now, cpu
            return self._chain(now)
        dt = now - self._mark_t
        busy = min(1.0, max(0.0, (cpu - self._mark_cpu) / dt))
        rate = 1.0 - busy * (1.0 - self.busy_rate)
        t = self._mark_t
        pending, left, stalled = self.pending, self._left, self._stalled
        while pending:
            h = pending[0]
            seg = max(t, h.start)
            if seg >= now:
                break
            need = left[h.seq]
            # Its stall first: the compute it has still to sit out takes ``ahead / busy`` of wall
            # time (the compute spread evenly over the interval), in which only the idle part moves.
            ahead = stalled.get(h.seq, 0.0)
            w1 = min(now - seg, ahead / busy) if ahead > 0 and busy > 0 else 0.0
            idle = 1.0 - busy
            can1 = idle * w1
            if can1 >= need - EPS and idle > 0:
                end = seg + max(0.0, need) / idle
            elif can1 + rate * (now - seg - w1) >= need - EPS:
                end = seg + w1 + max(0.0, need - can1) / rate
            else:
                left[h.seq] = need - can1 - rate * (now - seg - w1)
                if ahead > 0:
                    stalled[h.seq] = ahead - busy * w1
                break
            h.end = end
            pending.popleft()
            del left[h.seq]
            del self._need[h.seq]
            stalled.pop(h.seq, None)
            t = h.end
            if pending:
                nxt = pending[0]
                nxt.start = max(nxt.start, h.end)
        self._mark_t, self._mark_cpu = now, cpu
        return self._chain(now)

    def _chain(self, now: float) -> float:
        # Tentative ends: the head finishes its remaining work from now on an idle host; the
        # ones behind it follow in FIFO order.
        last = float("-inf")
        for i, r in enumerate(self.pending):
            left = self._left[r.seq]
            if i == 0 and r.start <= now:
                r.end = now + left
            else:
                r.start = max(r.start, last)
                r.end = r.start + left
            last = r.end
        return last

    def done(self, r: "OpRecord") -> bool:
        """Whether ``r`` has finished (as of the last settle)."""
        return r.seq not in self._left
