"""Robust figures from a calibration's samples: the median's interval, and each size's time from its neighbours' samples too.

A sweep sample on a shared host is the link's time plus, now and then, a wait for a core: the
samples of one size have a floor and a long upper tail (100 Mbit/s, 1 MiB all-reduce: 88.4,
97.6, 101.9 ms in one calibration, 89.5-93.6 in the next). With one sample a pass, the median
of three moved 5-10 % between calibrations at DDP's bucket sizes, and the calibrated model
interpolates those medians. Two remedies, both for any library on any fabric:

- ``median_interval``: a distribution-free interval of a median from order statistics, so the
  sweep can sample a size until its interval is narrow (``neuronabox.fidelity.measure``);
- ``local_times``: each size's time from a least-absolute-relative-error line through its own
  samples and those of the sizes within a factor ``span`` of it. Time is close to linear in the
  size over a factor of two (NCCL's protocol switches and gloo's algorithm switches are kinks of
  a piecewise line), so the neighbours' samples are evidence about this size, and an L1 line
  ignores a minority of disturbed samples among the three sizes' where the median of one size
  follows a disturbed majority of its few. The line's value is then held within the size's own
  ``median_interval``: neighbours choose among what this size's samples allow, so a kink between
  three sizes (latency giving way to bandwidth) cannot move a size off its own, and a size all
  of whose samples were disturbed keeps its fastest (with few samples the interval is min..max).
"""

from __future__ import annotations

import math
import statistics
from typing import Sequence

__all__ = ["median_interval", "median_halfwidth", "l1_line", "local_times", "LOCAL_SPAN"]

LOCAL_SPAN = 2.0  # a size's neighbours: within this factor (one step each side of a doubling sweep)


def median_interval(samples: Sequence[float], z: float = 1.96) -> tuple[float, float]:
    """The order statistics bounding the median at about ``z`` normal sigmas (binomial, n/2 ± z·√n/2); min..max below 6 samples."""
    xs = sorted(samples)
    n = len(xs)
    if n == 0:
        return (math.nan, math.nan)
    half = z * math.sqrt(n) / 2
    lo = max(0, math.floor(n / 2 - half))
    hi = min(n - 1, math.ceil(n / 2 + half) - 1)
    return xs[lo], xs[max(lo, hi)]


def median_halfwidth(samples: Sequence[float], z: float = 1.96) -> float:
    """Half the median's interval over the median (relative); infinite with fewer than 5 samples.

    Below 5 the interval is min..max and covers the median less often than asked (3 samples: 75 %,
    5: 94 %): three samples within +-2 % of each other stopped a 1 MiB all-reduce's top-up once
    at 100 Mbit/s (89.5-91.1 ms), 6-10 % below the four other calibrations' settled times.
    """
    if len(samples) < 5:
        return math.inf
    lo, hi = median_interval(samples, z)
    med = statistics.median(samples)
    return (hi - lo) / 2 / med if med > 0 else math.inf


def l1_line(s: Sequence[float], t: Sequence[float], iterations: int = 60) -> tuple[float, float]:
    """``t = a + b·s`` minimising the sum of absolute relative errors, a, b >= 0 (reweighted least squares); returns (a, b).

    Least absolute error is the median's line: half the points above, half below, however far
    a disturbed one lies. Relative, so every size counts alike.
    """
    pts = [(float(x), float(y)) for x, y in zip(s, t) if y > 0]
    if not pts:
        raise ValueError("l1_line: no positive time")
    if len({x for x, _ in pts}) < 2:
        return statistics.median(y for _, y in pts), 0.0
    a, b = 0.0, statistics.median(y / x for x, y in pts if x > 0) if any(x > 0 for x, _ in pts) else 0.0
    for _ in range(iterations):
        # Weight 1/|r| turns squares into absolute values; the floor keeps an exact point finite.
        w = [1.0 / max(abs((a + b * x - y) / y), 1e-6) / (y * y) for x, y in pts]
        sw = sum(w)
        sws = sum(wi * x for wi, (x, _) in zip(w, pts))
        swss = sum(wi * x * x for wi, (x, _) in zip(w, pts))
        swt = sum(wi * y for wi, (_, y) in zip(w, pts))
        swst = sum(wi * x * y for wi, (x, y) in zip(w, pts))
        det = sw * swss - sws * sws
        if det <= 1e-300 * max(1.0, sw * swss):
            break
        na, nb = (swss * swt - sws * swst) / det, (sw * swst - sws * swt) / det
        if na < 0:  # no negative latency: a line through the origin
            na, nb = 0.0, swst / swss
        elif nb < 0:  # no negative bandwidth: a level
            na, nb = swt / sw, 0.0
        if abs(na - a) <= 1e-12 * max(abs(na), 1e-30) and abs(nb - b) <= 1e-12 * max(abs(nb), 1e-30):
            a, b = na, nb
            break
        a, b = na, nb
    return a, b


def local_times(rows: Sequence[dict], span: float = LOCAL_SPAN) -> list[float]:
    """Per sweep row (``size``, ``samples``), its time on an L1 line through the samples of the rows within ``span`` of its size, held within its own median's interval.

    A row without samples (a profile from before they were kept) keeps its ``time_s``; a size
    with no neighbour in reach is its own samples' median.
    """
    out = []
    for row in rows:
        size = float(row["size"])
        near = [r for r in rows if r.get("samples") and size / span <= float(r["size"]) <= size * span]
        if not row.get("samples"):
            out.append(float(row["time_s"]))
            continue
        xs = [float(r["size"]) for r in near for _ in r["samples"]]
        ys = [float(v) for r in near for v in r["samples"]]
        a, b = l1_line(xs, ys)
        lo, hi = median_interval(row["samples"])
        out.append(min(max(a + b * size, lo), hi))
    return out
