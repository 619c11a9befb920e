"""Gloo's spin stalls: an op issued by a training step can wait milliseconds on its own rank's core.

Gloo's I/O thread handles a socket only when it takes the pair's lock without waiting. While
another thread of the rank holds that lock, epoll reports the socket again and again and the
I/O thread spins; with one core per rank, the holder then waits for that very core, and the op
stalls until the scheduler rotates (2.5-6 ms on the 2-core machine), burning the core all the
while. Back-to-back loops (nccl-tests, the calibration's sweep) rarely meet it; ops issued after
or beside compute, as DDP's buckets are, often do: at 10 Gbit/s it was most of the iteration
time that model mode lacked (the CNN's last bucket, 0.37 MB, took 4.5-6.6 ms in the real
system and 1.3 ms emulated).

``nbox calibrate`` measures it (profile field ``spin_stall``: per size and idle gap, samples of
the op's wall-time excess and each rank's CPU excess, for ops issued that long after compute:
after 2 ms an op stalled in some runs and not in others, after 20 ms in most). The timeline draws
one sample per op issued with its communicator idle (not back to back after its predecessor,
and not beside it: one I/O thread serves both, so they share one stall): the op's bytes move the
sample's wall excess later, and this rank's core spends one rank's CPU excess (a random one of the
sample's ranks, as this rank is any of them) through the footprint thread. The gap is how long
the communicator was idle before the op was issued. In wire mode the wire thread waits instead,
and only as long as a rank spun (the rest of the excess is the path's, which real sockets pay).
"""

from __future__ import annotations

import bisect
import copy
import ctypes
import math
import random
import time
from typing import TYPE_CHECKING

from .base import HostEffect, RunContext

if TYPE_CHECKING:
    from ..timeline import OpRecord

__all__ = ["SpinStall", "BACK_TO_BACK_S", "FASTEST_SHARE", "wait_spinning"]

# An op issued within this long of its predecessor's end is part of a back-to-back loop: the
# sweep's loops, which rarely stall, are what the profile's times already hold.
BACK_TO_BACK_S = 0.5e-3
# An op after compute drawn faster than the profile's time keeps at least this share of it: the
# draw's excess was measured at the nearest calibrated size, which can be far from the op's.
FASTEST_SHARE = 0.1


class SpinStall(HostEffect):
    """Draws (wall excess, this rank's CPU excess) for an op of a given size and idle gap from calibrated samples.

    Samples keep the process group they were measured in: each gloo context stalls at a rate of
    its own (1 MiB after 2 ms of compute: 0 to 21 of 22 ops in six groups of one process), and a
    job keeps its communicator for life. ``for_communicator`` picks one measured group for a new
    communicator, so emulated runs differ from each other as real runs do.
    """

    name = "spin stalls"

    def __init__(self, cells: dict[tuple[int, float], list[tuple[int, list[float]]]], seed: int | None = None):
        self._sizes = sorted({s for s, _ in cells})
        self._size_logs = [math.log(max(1, s)) for s in self._sizes]
        self._gaps = {s: sorted(g for s2, g in cells if s2 == s) for s in self._sizes}
        self._gap_logs = {s: [math.log(max(g, 1e-6)) for g in gaps] for s, gaps in self._gaps.items()}
        self._tagged = cells  # (group, sample) per cell
        self._groups = sorted({g for rows in cells.values() for g, _ in rows})
        self._cells = {c: [r for _, r in rows] for c, rows in cells.items()}  # what draws pick from: every group's
        self._spin_only = False
        self._wire = False  # built for wire mode: each communicator's view waits only what a rank spun
        self._rng = random.Random(seed)

    @classmethod
    def build(cls, run: RunContext) -> "SpinStall | None":
        """The profile's stalls for a gloo run timed by the model or the wire thread (hybrid ops are gloo's own).

        Also in wire mode, whose client moves the bytes but is not gloo: the wire thread waits and
        spins them. Unseeded: which measured process group a communicator follows differs from run
        to run, as the real runs differ (10 Gbit/s MLP: run medians 5.3-9.6 ms, one run in five
        stalling).
        """
        if run.hybrid or run.library != "gloo":
            return None
        stall = cls.from_profile(run.profile)
        if stall is not None:
            stall._wire = run.wire
        return stall

    def for_timeline(self) -> "SpinStall":
        """A new communicator's view (``for_communicator``)."""
        return self.for_communicator(spin_only=self._wire)

    def on_start(self, r: "OpRecord", gap: float) -> None:
        """Draw a stall for an op issued on an idle communicator: its bytes move that much later (or it is faster).

        Not back to back after its predecessor (the profile's times hold those), nor beside it:
        one I/O thread spins for both, so an op issued while the previous one runs shares its stall.
        """
        if gap < BACK_TO_BACK_S:
            return
        excess, r.spin = self.draw(r.nbytes, gap)
        if excess >= 0:
            # The bytes move once the spin ends: a wall-clock wait, which the host's compute
            # does not stretch as it stretches the transfer (host coupling).
            r.stall = excess
            r.start += excess
        else:
            # Faster than the profile's time (the sweep's median of two modes): shorter.
            r.duration = max(FASTEST_SHARE * r.duration, r.duration + excess)

    def describe(self) -> str:
        """How many calibrated cells the draws come from."""
        how = "the wire thread waits what a rank spun" if self._wire else "bytes move after it, spin on this core"
        return f"spin stalls: drawn per op issued on an idle communicator from {len(self._cells)} cells ({how})"

    @classmethod
    def from_profile(cls, profile: dict | None, seed: int | None = None) -> "SpinStall | None":
        """The profile's stall samples, or None when it has none (or no op ever took longer)."""
        if not profile or not isinstance(profile.get("spin_stall"), dict):
            return None
        cells = {}
        for c in profile["spin_stall"].get("cells") or []:
            samples = c.get("samples") or []
            groups = c.get("groups") or [0] * len(samples)
            rows = [(int(g), list(map(float, r))) for g, r in zip(groups, samples) if len(r) >= 2]
            if rows:
                cells[(int(c["size"]), float(c["gap_s"]))] = rows
        if not cells or not any(r[0] > 0 for rows in cells.values() for _, r in rows):
            return None
        return cls(cells, seed)

    def for_communicator(self, spin_only: bool = False) -> "SpinStall":
        """A view drawing only from one measured process group, picked at random (a new communicator's).

        ``spin_only``: the op waits only as long as a rank spun (the sample's largest CPU excess),
        not its whole wall excess, which also holds what the path itself costs after idling. Wire
        mode's real sockets and relay pay that part for real (at 1 Gbit/s the whole excess made
        it 6.5 % slow where it had been within 1.6 %).
        """
        view = copy.copy(self)
        group = self._rng.choice(self._groups)
        # Filtered once here, not per op (a cell without this group's samples keeps every group's).
        view._cells = {c: [r for g, r in rows if g == group] or self._cells[c] for c, rows in self._tagged.items()}
        view._rng = random.Random(self._rng.random())
        view._spin_only = spin_only
        return view

    @staticmethod
    def _nearest(logs: list[float], x: float) -> int:
        i = bisect.bisect_left(logs, x)
        if i == 0:
            return 0
        if i == len(logs):
            return len(logs) - 1
        return i if logs[i] - x < x - logs[i - 1] else i - 1

    def _cells_for(self, nbytes: int, gap: float) -> list[tuple[float, list[list[float]]]]:
        # The nearest measured size on a log scale; of its gaps, the two around ``gap``, weighted
        # by nearness on a log scale (the nearest alone made a step: the 10 Gbit/s MLP's gaps,
        # 2.3-3.3 ms, straddle the midpoint of 2 and 6 ms, and each side stalls differently).
        size = self._sizes[self._nearest(self._size_logs, math.log(max(1, nbytes)))]
        gaps, logs = self._gaps[size], self._gap_logs[size]
        x = math.log(max(gap, 1e-6))
        i = bisect.bisect_left(logs, x)
        if i == 0 or i == len(logs):
            return [(1.0, self._cells[(size, gaps[min(i, len(gaps) - 1)])])]
        w = (x - logs[i - 1]) / (logs[i] - logs[i - 1])
        return [(1.0 - w, self._cells[(size, gaps[i - 1])]), (w, self._cells[(size, gaps[i])])]

    def draw(self, nbytes: int, gap: float) -> tuple[float, float]:
        """(wall excess over the profile's time, CPU seconds this rank's core spins) for one op of ``nbytes`` issued ``gap`` s after the last.

        A positive excess is a wait before the bytes move; a negative one (newer profiles keep
        the sign) an op faster than the sweep's median, which at 10 Gbit/s sits between two modes.
        """
        cells = self._cells_for(nbytes, gap)
        rows = cells[0][1] if len(cells) == 1 or self._rng.random() < cells[0][0] else cells[1][1]
        row = self._rng.choice(rows)
        cpus = row[1:]
        own = self._rng.choice(cpus) if cpus else 0.0
        wall = max(max(cpus, default=0.0), 0.0) if self._spin_only else row[0]
        return wall, max(0.0, own)

    def mean(self, nbytes: int, gap: float) -> tuple[float, float]:
        """Mean (wall excess, one rank's CPU excess) at ``nbytes`` and ``gap``: what the draws average to."""
        wall = own = 0.0
        for w, rows in self._cells_for(nbytes, gap):
            wall += w * sum(r[0] for r in rows) / len(rows)
            cpus = [c for r in rows for c in r[1:]]
            own += w * (sum(cpus) / len(cpus) if cpus else 0.0)
        return wall, own


_CHUNK = 64 << 10  # bytes per memcpy: tens of microseconds, so the deadline is checked often


def wait_spinning(stall: float, spin: float) -> None:
    """Wait ``stall`` seconds, spending ``spin`` of them in CPU on this thread as gloo's spinning I/O thread does.

    The spin is ``memcpy`` through ctypes, which drops the GIL, like the footprint's work; the
    rest of the stall is slept.
    """
    end = time.perf_counter() + stall
    if spin > 0:
        src, dst = ctypes.create_string_buffer(_CHUNK), ctypes.create_string_buffer(_CHUNK)
        t0 = time.thread_time()
        while time.thread_time() - t0 < spin and time.perf_counter() < end:
            ctypes.memmove(dst, src, _CHUNK)
    left = end - time.perf_counter()
    if left > 0:
        time.sleep(left)
