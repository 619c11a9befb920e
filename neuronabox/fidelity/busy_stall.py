"""The busy-progress curve's fit: what an all-reduce loses against how long the host computes beside it.

``nbox calibrate`` starts an all-reduce on every rank and computes beside it for windows of
``c`` seconds, from a 32nd of the long op's idle time to all of it, each beside the smallest op
that lasts about as long; the op then takes ``loss`` longer than on idle ranks. The model
(``emu/host_effects/host_coupling.py``) reads two figures: the op makes no progress over its
first ``stall`` seconds of compute, then moves at ``rate``:

    loss(c) = min(c, stall) + (1 - rate) · max(0, c - stall)

A single rate over the whole op (``stall`` 0) is the special case. The fit is least absolute
deviations over every sample: the losses spread over several ms (the op's threads got the core
at once, or a scheduler's turn later), and a stray scheduler delay makes a few 20-50 ms long.
Five calibrations' samples (2-core VM, 300 Mbit/s) read the stall 3.2-3.5 ms by it and
3.3-4.7 ms by least squares over each window's middle 80 %, whose bootstrap spread was no
smaller.
"""

from __future__ import annotations

import statistics
from typing import Sequence

__all__ = ["fit_busy_stall", "fit_windows", "busy_loss"]

STALL_STEPS = 200  # stall candidates from 0 to the longest window


def busy_loss(c: float, stall: float, rate: float) -> float:
    """Seconds an op loses beside ``c`` seconds of compute: none of its progress over ``stall``, then ``1 - rate`` of it."""
    return min(c, stall) + (1.0 - rate) * max(0.0, c - stall)


def _lad_slope(xs: list[float], ys: list[float]) -> float:
    """The slope s >= 0 minimising sum |y - s·x| (x > 0): the median of y/x weighted by x."""
    pts = sorted((y / x, x) for x, y in zip(xs, ys) if x > 0)
    if not pts:
        return 0.0
    half, acc = sum(w for _, w in pts) / 2.0, 0.0
    for slope, w in pts:
        acc += w
        if acc >= half:
            return max(0.0, slope)
    return max(0.0, pts[-1][0])


def fit_busy_stall(points: Sequence[tuple[float, float]], min_rate: float = 0.0) -> tuple[float, float]:
    """(stall seconds, rate after it) fitted to (compute seconds, loss seconds) samples by least absolute deviations."""
    pts = [(float(c), float(loss)) for c, loss in points if c > 0]
    if not pts:
        raise ValueError("fit_busy_stall: no sample with compute beside the op")
    longest = max(c for c, _ in pts)
    best: tuple[float, float, float] | None = None
    for i in range(STALL_STEPS + 1):
        stall = longest * i / STALL_STEPS
        after = [(c - stall, loss - stall) for c, loss in pts if c > stall]
        slope = _lad_slope([x for x, _ in after], [y for _, y in after]) if after else 0.0
        rate = max(min_rate, min(1.0, 1.0 - slope))
        cost = sum(abs(loss - busy_loss(c, stall, rate)) for c, loss in pts)
        if best is None or cost < best[0] - 1e-12:
            best = (cost, stall, rate)
    assert best is not None
    return best[1], best[2]


def fit_windows(idle_s: float, windows: Sequence[dict]) -> tuple[float, float]:
    """(stall seconds, rate after it) from a profile's ``busy_progress.windows``: each op's time beside a window, less its idle time.

    A window measured beside an op of its own keeps that op's idle samples; older profiles timed
    every window beside one op, whose idle time is ``idle_s``.
    """
    points = []
    for w in windows:
        idle = statistics.median(w["idle_samples"]) if w.get("idle_samples") else idle_s
        points += [(w["compute_s"], took - idle) for took in w["samples"]]
    return fit_busy_stall(points)
