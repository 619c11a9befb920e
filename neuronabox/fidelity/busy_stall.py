"""The busy-progress curve's fit: what an all-reduce loses against how long the host computes beside it.

``nbox calibrate`` starts an all-reduce on every rank and computes beside it for windows of
``c`` seconds, from a 32nd of the long op's idle time to all of it, each beside the smallest op
that lasts about as long; the op then takes ``loss`` longer than on idle ranks. The model (``emu/host_effects/host_coupling.py``) reads two figures:
the op makes no progress over its first ``stall`` seconds of compute, then moves at ``rate``:

    loss(c) = min(c, stall) + (1 - rate) · max(0, c - stall)

A single rate over the whole op (``stall`` 0) is the special case. The fit is least squares
over each window's samples less their highest and lowest tenth. The losses spread over several
ms (the op's threads got the core at once, or a scheduler's turn later), and a step's time sums
the losses of the ops it overlaps: a mean follows that sum; the trimmed tenths drop the rare
samples a stray scheduler delay made 20-50 ms long. On five calibrations' samples (2-core VM,
300 Mbit/s) it cut the stall's bootstrap spread by about 30 % against least absolute deviations.
"""

from __future__ import annotations

from typing import Sequence

__all__ = ["fit_busy_stall", "fit_windows", "busy_loss"]

STALL_STEPS = 200  # stall candidates from 0 to the longest window


def busy_loss(c: float, stall: float, rate: float) -> float:
    """Seconds an op loses beside ``c`` seconds of compute: none of its progress over ``stall``, then ``1 - rate`` of it."""
    return min(c, stall) + (1.0 - rate) * max(0.0, c - stall)


TRIM = 0.1  # of each window's samples, this share at either end is left out of the fit


def _trimmed(points: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """The samples less the highest and lowest ``TRIM`` of each window's losses."""
    by: dict[float, list[float]] = {}
    for c, loss in points:
        by.setdefault(c, []).append(loss)
    out = []
    for c, losses in by.items():
        losses.sort()
        k = int(len(losses) * TRIM)
        out += [(c, loss) for loss in losses[k:len(losses) - k]]
    return out


def fit_busy_stall(points: Sequence[tuple[float, float]], min_rate: float = 0.0) -> tuple[float, float]:
    """(stall seconds, rate after it) fitted to (compute seconds, loss seconds) samples: least squares, trimmed per window."""
    pts = _trimmed([(float(c), float(loss)) for c, loss in points if c > 0])
    if not pts:
        raise ValueError("fit_busy_stall: no sample with compute beside the op")
    longest = max(c for c, _ in pts)
    best: tuple[float, float, float] | None = None
    for i in range(STALL_STEPS + 1):
        stall = longest * i / STALL_STEPS
        # Past the stall the loss grows by (1 - rate) a second: that slope through (stall, stall).
        sxx = sum((c - stall) ** 2 for c, _ in pts if c > stall)
        sxy = sum((c - stall) * (loss - stall) for c, loss in pts if c > stall)
        slope = max(0.0, sxy / sxx) if sxx > 0 else 0.0
        rate = max(min_rate, min(1.0, 1.0 - slope))
        cost = sum((loss - busy_loss(c, stall, rate)) ** 2 for c, loss in pts)
        if best is None or cost < best[0] - 1e-15:
            best = (cost, stall, rate)
    assert best is not None
    return best[1], best[2]


def fit_windows(idle_s: float, windows: Sequence[dict]) -> tuple[float, float]:
    """(stall seconds, rate after it) from a profile's ``busy_progress.windows``: each op's time beside a window, less its idle time.

    A window measured beside an op of its own keeps that op's idle samples; older profiles timed
    every window beside one op, whose idle time is ``idle_s``.
    """
    import statistics

    return fit_busy_stall([(w["compute_s"], took - (statistics.median(w["idle_samples"]) if w.get("idle_samples") else idle_s))
                           for w in windows for took in w["samples"]])
