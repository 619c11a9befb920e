"""When each emulated collective starts and ends: one FIFO timeline per communicator.

DESIGN.md, "Timing semantics": op *i* of a communicator starts at max(its inputs are ready,
op *i-1* finished) and finishes at start + modeled duration (+ what-if injections, which the
model already carries). The run's host effects (``host_effects/``: late peers, spin stalls, host
coupling, footprint) move the start, the duration or the end through their hooks, which
``schedule`` asks at fixed moments. Every op is recorded for reports.

All host times are ``time.perf_counter()`` seconds (CLOCK_MONOTONIC on Linux, the clock
``time.sleep`` and ``threading.Condition.wait`` sleep on), so deadlines and sleeps agree.
Ops on CUDA tensors are timed on the device (``cuda_wait``); their start and end are filled
in later from device timestamps, so the CPU never waits for them.
"""

from __future__ import annotations

import atexit
import ctypes
import heapq
import itertools
import threading
import time
from collections import deque
from typing import Callable

from ..collectives import Op
from ..model.base import CommModel, Group
from ..stats import percentile
from .host_effects.base import HostEffect, hooks

__all__ = [
    "clock",
    "ContentionHook",
    "OpRecord",
    "Recorder",
    "Timeline",
    "Waker",
    "sleep_until",
    "tune_thread_timer_slack",
    "percentile",
]

clock = time.perf_counter

# (timeline, op, nbytes, root, start) -> (duration, algorithm) when other communicators' ops in
# flight at ``start`` slow this one down, else None. Set by the Emulator for models that see contention.
ContentionHook = Callable[["Timeline", Op, int, int, float], "tuple[float, str] | None"]


class OpRecord:
    """One emulated operation: what it was, when it was called, started, ended, and how long the caller waited."""

    __slots__ = (
        "seq", "comm", "op", "group", "nbytes", "root", "algorithm", "iteration",
        "enqueue", "ready", "start", "end", "duration", "extra",
        "wait", "completed", "device", "device_slot", "coupled", "holds", "stall", "spin", "event",
    )

    def __init__(self, seq, comm, op, group, nbytes, root, algorithm, iteration, enqueue, duration, extra):
        self.seq: int = seq
        self.comm: str = comm
        self.op: Op = op
        self.group: Group = group
        self.nbytes: int = nbytes
        self.root: int = root
        self.algorithm: str = algorithm
        self.iteration: int = iteration
        self.enqueue: float = enqueue  # when the real rank called it
        self.duration: float = duration  # modeled, injections included
        self.extra: float = extra  # how late the slowest rank arrives after the real rank
        self.ready: float | None = None  # inputs ready (CUDA ops: unknown until resolved)
        self.start: float | None = None
        self.end: float | None = None  # modeled finish
        self.wait: float = 0.0  # seconds the caller blocked in Work.wait()
        self.completed: float | None = None  # when the emulator actually signalled completion (CPU path)
        self.device: str | None = None  # "cuda:0" for device-timed ops
        self.device_slot: object = None  # where cuda_wait stored the device timestamps
        self.coupled: Timeline | None = None  # set when a host effect makes the end tentative (host_coupling)
        self.holds: tuple[HostEffect, ...] = ()  # host effects that hold its completion past its end (footprint)
        self.stall: float = 0.0  # gloo's spin stall drawn for it: the bytes move this much later (spin_stall)
        self.spin: float = 0.0  # of which this rank's core spun (CPU seconds)
        self.event: int = -1  # its entry in a role profile being recorded (role_record.py)

    @property
    def lateness(self) -> float | None:
        """Actual minus modeled completion, when it was measured."""
        if self.completed is None or self.end is None:
            return None
        return self.completed - self.end

    def as_dict(self, t0: float = 0.0) -> dict:
        """A JSON-friendly view, times in seconds since ``t0``."""

        def rel(t):
            return None if t is None else t - t0

        return {
            "seq": self.seq,
            "comm": self.comm,
            "op": self.op.value,
            "ranks": len(self.group),
            "nbytes": self.nbytes,
            "algorithm": self.algorithm,
            "iteration": self.iteration,
            "enqueue": rel(self.enqueue),
            "ready": rel(self.ready),
            "start": rel(self.start),
            "end": rel(self.end),
            "duration": self.duration,
            "extra": self.extra,
            "stall": self.stall,
            "wait": self.wait,
            "lateness": self.lateness,
            "device": self.device,
        }

    def __repr__(self) -> str:
        return (
            f"OpRecord(#{self.seq} {self.op.value} {self.comm} {self.nbytes}B "
            f"dur={self.duration * 1e6:.1f}us wait={self.wait * 1e6:.1f}us)"
        )


class Recorder:
    """Every emulated op and every iteration boundary of one run, for reports."""

    def __init__(self):
        self.t0 = clock()
        self.ops: list[OpRecord] = []
        self.iteration_marks: list[float] = []  # host time at the end of each iteration
        self._seq = itertools.count()
        self._lock = threading.Lock()
        self._manual = False
        # Called before reading device-timed records (cuda_wait registers its readback here).
        self.resolvers: list[Callable[[], None]] = []
        self.iteration_listeners: list[Callable[[int], None]] = []
        # CUDA runs: device -> {iteration index -> when the device stream reached the mark (host clock)}
        self.device_iteration_marks: dict[str, dict[int, float]] = {}

    @property
    def iteration(self) -> int:
        """The index of the iteration now running (0 before the first mark)."""
        return len(self.iteration_marks)

    def next_seq(self) -> int:
        """A run-wide order number for a new op."""
        return next(self._seq)

    def add(self, rec: OpRecord) -> None:
        """Keep one op."""
        self.ops.append(rec)  # list.append is atomic under the GIL

    def mark_iteration(self, manual: bool = False) -> None:
        """Mark the end of an iteration now; once the user marks by hand, optimizer steps stop counting."""
        if manual:
            self._manual = True
        elif self._manual:
            return
        now = clock()
        with self._lock:
            self.iteration_marks.append(now)
            index = len(self.iteration_marks) - 1
        for listener in self.iteration_listeners:
            listener(index)

    def resolve(self) -> None:
        """Fill in device-timed records (may synchronize the device: call it at report time, not in the loop)."""
        for fn in self.resolvers:
            fn()

    def iteration_times(self) -> list[float]:
        """Wall seconds of each iteration (the first one counts from the recorder's start)."""
        marks = [self.t0] + self.iteration_marks
        return [b - a for a, b in zip(marks, marks[1:])]

    def device_iteration_times(self, device: str | None = None) -> list[float]:
        """Seconds between consecutive iteration marks as the device stream reached them (CUDA runs; resolve first)."""
        if not self.device_iteration_marks:
            return []
        marks = self.device_iteration_marks[device or next(iter(self.device_iteration_marks))]
        ordered = [marks[i] for i in sorted(marks)]
        return [b - a for a, b in zip(ordered, ordered[1:])]

    def lateness(self) -> list[float]:
        """Measured completion lateness (actual minus modeled finish) of every op that has one, in seconds."""
        return [r.lateness for r in self.ops if r.lateness is not None]

    def summary(self) -> dict:
        """Per-op counts, bytes, modeled and waited seconds, and iteration times."""
        self.resolve()
        per_op: dict[str, dict] = {}
        for r in self.ops:
            s = per_op.setdefault(r.op.value, {"count": 0, "bytes": 0, "modeled_s": 0.0, "waited_s": 0.0})
            s["count"] += 1
            s["bytes"] += r.nbytes
            s["modeled_s"] += r.duration + r.extra + r.stall
            s["waited_s"] += r.wait
        return {
            "ops": per_op,
            "iterations": self.iteration_times(),
            "device_iterations": self.device_iteration_times(),
            "waited_s": sum(r.wait for r in self.ops),
        }


def sleep_until(deadline: float) -> None:
    """Sleep (never spin) until ``clock()`` reaches ``deadline``."""
    delay = deadline - clock()
    while delay > 0:
        time.sleep(delay)
        delay = deadline - clock()


_PR_SET_TIMERSLACK = 29
_tuned_threads: set[int] = set()


def tune_thread_timer_slack(nanoseconds: int = 1000) -> None:
    """Lower this thread's timer slack (Linux default 50 us), so sleeps end closer to their deadline."""
    ident = threading.get_ident()
    if ident in _tuned_threads:
        return
    _tuned_threads.add(ident)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_TIMERSLACK, ctypes.c_ulong(nanoseconds), 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the default slack only costs precision
        pass


class Waker:
    """One daemon thread that sleeps on a heap of deadlines and runs each callback at its time.

    It exists only for futures (DDP's reducer and ``.then`` chains wait on them from C++);
    ``Work.wait()`` sleeps in the caller and needs no thread. Callbacks run outside the lock.
    """

    def __init__(self):
        self._heap: list[tuple[float, int, Callable[[float], None]]] = []
        self._cond = threading.Condition(threading.Lock())
        self._seq = itertools.count()
        self._thread: threading.Thread | None = None
        self._stopped = False

    def at(self, deadline: float, callback: Callable[[float], None]) -> None:
        """Run ``callback(actual_time)`` at ``deadline`` (at once if it has passed)."""
        with self._cond:
            if self._stopped:
                return
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="nbox-waker", daemon=True)
                self._thread.start()
                # A callback completes a torch future, whose C++ then-callbacks call back into
                # Python; a daemon thread doing that while the interpreter finalizes is killed
                # inside C++ frames and the process aborts ("terminate called without an active
                # exception") when a script exits with ops in flight. Stop it before that.
                atexit.register(self.stop)
            heapq.heappush(self._heap, (deadline, next(self._seq), callback))
            if self._heap[0][0] == deadline:
                self._cond.notify()

    def pending(self) -> int:
        """How many callbacks wait."""
        return len(self._heap)

    def stop(self, timeout: float = 5.0) -> None:
        """Drop the callbacks still waiting and end the thread once the running one returns."""
        with self._cond:
            self._stopped = True
            self._heap.clear()
            self._cond.notify()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def _run(self) -> None:
        tune_thread_timer_slack()
        heap, cond = self._heap, self._cond
        while True:
            with cond:
                while True:
                    if self._stopped:
                        return
                    if not heap:
                        cond.wait()
                        continue
                    delay = heap[0][0] - clock()
                    if delay <= 0:
                        _, _, callback = heapq.heappop(heap)
                        break
                    cond.wait(delay)
            try:
                callback(clock())
            except Exception:  # noqa: BLE001 - a failing user callback must not stop every later completion
                import traceback

                traceback.print_exc()


class Timeline:
    """One communicator's FIFO queue of emulated ops (NCCL runs a communicator's ops in order on one stream)."""

    def __init__(
        self,
        name: str,
        group: Group,
        model: CommModel,
        recorder: Recorder,
        effects: "tuple[HostEffect, ...] | list[HostEffect]" = (),
    ):
        self.name = name
        self.group = group
        self.model = model
        self.recorder = recorder
        self.last_end = float("-inf")
        self._cache: dict[tuple[Op, int, int], tuple[float, str]] = {}
        self._links: dict[tuple[Op, int, int], float | None] = {}
        self._lock = threading.Lock()
        self.device_state: dict = {}  # per-device streams and buffers of cuda_wait
        self.contention: ContentionHook | None = None
        # Ops in flight at once. NCCL: 1 (one stream, FIFO). Gloo: a process group has 2 worker
        # threads, so a second op runs beside the first; what overlaps is its idle part and
        # the link time the first leaves idle (``_overlap``), only the rest queues on the link:
        # ``end = max(start + t, previous end + t - overlap)``.
        self.slots = 1
        # The last few host-timed ops: by FIFO order, the one in flight at any recent time is among them.
        self.recent: deque[OpRecord] = deque(maxlen=4)
        self.effects: tuple[HostEffect, ...] = ()
        self.attach(*effects)

    def attach(self, *effects: HostEffect) -> None:
        """Add host effects (each one's per-communicator part, ``HostEffect.for_timeline``) to this communicator."""
        every = (*self.effects, *effects)
        admits = hooks(every, "admit")
        if len(admits) > 1:
            names = [e.name for e in every if hooks((e,), "admit")]
            raise ValueError(f"nbox: two host effects take over an op's end: {names}")
        with self._lock:
            self.effects = every
            self._arrivals = hooks(every, "arrival")
            # The effects that account host progress: settled before an op is queued and on waits.
            self._settlers = tuple(e for e in every if hooks((e,), "settle"))
            self._on_start = hooks(every, "on_start")
            self._lost = hooks(every, "lost")
            self._admit = admits[0] if admits else None
            self._on_queued = hooks(every, "on_queued")

    def effect(self, kind: type) -> HostEffect | None:
        """This communicator's host effect of class ``kind``, if it has one."""
        return next((e for e in self.effects if isinstance(e, kind)), None)

    def _settle(self, now: float) -> None:
        # Under the lock: account the host's progress up to ``now``; pending ops may end later.
        for e in self._settlers:
            self.last_end = max(self.last_end, e.settle(now))

    def in_flight(self, t: float) -> OpRecord | None:
        """The host-timed op of this communicator running at time ``t``, if any."""
        for r in reversed(tuple(self.recent)):  # a snapshot: another thread may be appending
            if r.start <= t < r.end:
                return r
            if r.end <= t:
                return None
        return None

    def estimate(self, op: Op, nbytes: int, root: int = 0) -> tuple[float, str]:
        """Modeled duration (what-if injections included) and algorithm; cached per (op, bytes, root)."""
        key = (op, nbytes, root)
        hit = self._cache.get(key)
        if hit is None:
            try:
                est = self.model.estimate(op, nbytes, self.group, root)
            except (NotImplementedError, ValueError, KeyError):
                if op is not Op.BARRIER:
                    raise
                # A model without a barrier: NCCL's barrier is an all-reduce of one element.
                est = self.model.estimate(Op.ALL_REDUCE, 4, self.group, root)
            hit = (float(est.duration), est.algorithm)
            if len(self._cache) < 65536:  # a bound: some scripts send ever-changing sizes
                self._cache[key] = hit
        return hit

    def latency_part(self, op: Op, root: int = 0) -> float:
        """The size-independent part of ``op``'s time: the modeled time of a 4-byte one."""
        return self.estimate(op, 4, root)[0]

    def link_part(self, op: Op, nbytes: int, root: int = 0) -> float | None:
        """Seconds of ``op`` on the link when it shares it (the model's ``link_time``); None when the model cannot tell."""
        key = (op, nbytes, root)
        if key in self._links:
            return self._links[key]
        t = self.model.link_time(op, nbytes, self.group, root)
        if len(self._links) < 65536:
            self._links[key] = t
        return t

    def _overlap(self, r: OpRecord, prev: OpRecord | None, prev_end: float) -> float:
        """How much of ``r`` runs beside the op still in flight (``prev``, ending at ``prev_end``).

        With the link share of both ops known: ``r``'s own idle part (its time less its link
        time) and the link time ``prev`` leaves idle for the rest of its run. Else only the
        latency part (a 4-byte op) overlaps.
        """
        mine = self.link_part(r.op, r.nbytes, r.root)
        theirs = self.link_part(prev.op, prev.nbytes, prev.root) if prev is not None else None
        if mine is None or theirs is None or prev.duration <= 0:
            return min(self.latency_part(r.op, r.root), prev_end - r.start, r.duration)
        # Time ``prev`` lost to the host's compute is time its bytes waited on the CPU, not on the
        # link: its link share is over the time it really takes (100 Mbit/s CNN: the 2.1 MB bucket
        # ran 6 ms behind while the backward computed, and the 0.37 MB one issued then still ended
        # 17 ms after it, as with an idle host).
        lost = sum(h(prev) for h in self._lost)
        # While ``prev`` still waits out its spin stall none of its bytes move: the link is all
        # idle then, and ``r`` shares the stall (10 Gbit/s MLP: the real second bucket, issued
        # in the first's stall, ended 0.2-0.4 ms after it; shared at the link share, 0.8-0.9).
        waiting = max(0.0, min(prev.start, prev_end) - r.start) if prev.stall > 0 else 0.0
        idle = waiting + (prev_end - r.start - waiting) * max(0.0, 1.0 - theirs / (prev.duration + lost))
        return min(max(0.0, r.duration - mine) + idle, r.duration)

    def _record(self, op: Op, nbytes: int, root: int, now: float) -> OpRecord:
        duration, algorithm = self.estimate(op, nbytes, root)
        # A host effect says how late the group's slowest rank arrives (the latest, if several do).
        arrivals = self._arrivals
        extra = max(h(op, nbytes, self.group) for h in arrivals) if arrivals else 0.0
        rec = self.recorder
        return OpRecord(rec.next_seq(), self.name, op, self.group, nbytes, root, algorithm, rec.iteration, now, duration, extra)

    def schedule(self, op: Op, nbytes: int, root: int = 0, ready: float | None = None) -> OpRecord:
        """Queue a host-timed op whose inputs are ready at ``ready`` (default: now); returns its record."""
        now = clock()
        r = self._record(op, nbytes, root, now)
        r.ready = now if ready is None else ready
        with self._lock:
            self._settle(now)
            # A straggler delays the start (every rank must arrive), not the transfer.
            prev_end = self.last_end
            if self.slots == 1:
                r.start = max(r.ready + r.extra, prev_end)
            else:
                recent = self.recent
                free = recent[-self.slots].end if len(recent) >= self.slots else float("-inf")
                r.start = max(r.ready + r.extra, free)
            if self.contention is not None:
                hit = self.contention(self, op, nbytes, root, r.start)
                if hit is not None:
                    r.duration, r.algorithm = hit
            for h in self._on_start:  # spin stalls: the bytes move later
                h(r, r.ready - prev_end)
            overlap = 0.0
            beside = None
            if prev_end > r.start:  # only with slots > 1: the previous op is still running
                overlap = self._overlap(r, self.recent[-1] if self.recent else None, prev_end)
                # Gloo interleaves both ops' bytes on the pair's socket, so this op's CPU goes from
                # now on, beside the other's, not after it as the link time is counted.
                beside = r.start
            if self._admit is not None:  # host coupling: the end moves with the host's compute
                r.coupled = self
                self._admit(r, prev_end, r.duration - overlap)
            else:
                r.end = max(r.start + r.duration, prev_end + r.duration - overlap)
            self.last_end = r.end
            self.recent.append(r)
        for h in self._on_queued:  # the footprint charges the op's CPU
            h(r, beside)
        self.recorder.add(r)
        return r

    def settle(self, r: OpRecord) -> bool:
        """Host-coupled ops: account progress up to now; True when ``r`` is done (else ``r.end`` is its new tentative end)."""
        with self._lock:
            self._settle(clock())
            return all(e.done(r) for e in self._settlers)

    def place(self, r: OpRecord, arrival: float) -> None:
        """Fix the start and end of a recorded op whose arrival is known only now (hybrid ops), after the previous op.

        ``arrival`` is when the group's last rank arrived (the straggler delay included).
        """
        with self._lock:
            r.start = max(arrival, self.last_end)
            if self.contention is not None:
                hit = self.contention(self, r.op, r.nbytes, r.root, r.start)
                if hit is not None:
                    r.duration, r.algorithm = hit
            r.end = r.start + r.duration
            self.last_end = r.end
            self.recent.append(r)

    def schedule_device(self, op: Op, nbytes: int, device: str, root: int = 0) -> OpRecord:
        """Queue a device-timed op: its start and end come from the device later; returns its record."""
        r = self._record(op, nbytes, root, clock())
        r.device = device
        self.recorder.add(r)
        return r

