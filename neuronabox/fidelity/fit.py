"""The calibration's fit: per op, a piecewise alpha-beta model of time against size, in the ring's closed form.

Per op, time t(S) is piecewise linear in the size S, ``t = a + b·S`` on each segment
(a: latency terms, b: seconds per byte). Segments are found by dynamic programming over the
sorted sizes (least squares on relative error, so 4 B counts as much as 256 MiB) and their
number by BIC. A breakpoint is where two adjacent lines cross when they cross near the gap
between their sizes (a library choosing the faster algorithm, like NCCL's tuner, makes t
continuous there), else the geometric middle of the gap (a protocol switch: a jump).
Each segment is then expressed in the op's ring closed form for the measured group size n,
``t = L(n)·alpha + F(n)·S/B`` (all-reduce: L = 2(n-1), F = 2(n-1)/n), so the calibrated model
can scale it to other group sizes (``neuronabox.model.calibrated``).
"""

from __future__ import annotations

import math
import statistics
from typing import Any, Sequence

from ..collectives import Op
from ..errors import InputError
from ..model.profile import OpFit, Segment, ring_terms

__all__ = ["fit_line", "fit_piecewise", "link_estimate", "WIRE_PER_PAYLOAD"]


def fit_line(s: Sequence[float], t: Sequence[float]) -> tuple[float, float, float]:
    """Least squares of ``t = a + b·s`` on relative error with a, b >= 0; returns (a, b, sum of squared errors)."""
    # Normal equations of min sum ((a + b s - t) / t)^2, in closed form (segments are short).
    w = [1.0 / (x * x) for x in t]
    sw = sum(w)
    sws = sum(wi * si for wi, si in zip(w, s))
    swss = sum(wi * si * si for wi, si in zip(w, s))
    swt = sum(wi * ti for wi, ti in zip(w, t))
    swst = sum(wi * si * ti for wi, si, ti in zip(w, s, t))
    det = sw * swss - sws * sws
    a = b = None
    if det > 1e-300 * max(1.0, sw * swss) and len(s) > 1:
        a = (swss * swt - sws * swst) / det
        b = (sw * swst - sws * swt) / det
    if a is None or a < 0 or b < 0:
        # One parameter only: the better of a pure latency and a pure bandwidth line.
        cand = [(swt / sw, 0.0)]
        if swss > 0:
            cand.append((0.0, swst / swss))
        best = None
        for ca, cb in cand:
            sse = sum(((ca + cb * si - ti) / ti) ** 2 for si, ti in zip(s, t))
            if best is None or sse < best[2]:
                best = (ca, cb, sse)
        return best  # type: ignore[return-value]
    sse = sum(((a + b * si - ti) / ti) ** 2 for si, ti in zip(s, t))
    return a, b, sse


def _segment_dp(s: list[float], t: list[float], kmax: int, min_points: int) -> dict[int, tuple[float, list[int]]]:
    """For each segment count k, the least total error and the start indices of the segments."""
    m = len(s)
    cost = [[math.inf] * (m + 1) for _ in range(m + 1)]
    for i in range(m):
        for j in range(i + min_points, m + 1):
            cost[i][j] = fit_line(s[i:j], t[i:j])[2]
    # dp[k][j]: best error of the first j points cut into k segments
    dp = [[(math.inf, [])] * (m + 1) for _ in range(kmax + 1)]
    dp[0][0] = (0.0, [])
    for k in range(1, kmax + 1):
        for j in range(1, m + 1):
            cands = [(dp[k - 1][i][0] + cost[i][j], dp[k - 1][i][1] + [i])
                     for i in range(j) if dp[k - 1][i][0] < math.inf and cost[i][j] < math.inf]
            if cands:
                dp[k][j] = min(cands, key=lambda c: c[0])
    return {k: dp[k][m] for k in range(1, kmax + 1) if dp[k][m][0] < math.inf}


def fit_piecewise(
    sizes: Sequence[float],
    times: Sequence[float],
    op: Op | str = Op.ALL_REDUCE,
    n: int = 2,
    max_segments: int = 4,
    min_points: int = 3,
    noise_floor: float = 2e-3,
    outlier_floor: float = 0.25,
) -> OpFit:
    """Fit a piecewise ``t = a + b·S`` to (size, time) points; segments and breakpoints in the op's closed form."""
    op = Op.parse(op) if isinstance(op, str) else op
    pts = sorted((float(x), float(y)) for x, y in zip(sizes, times) if y > 0)
    if len(pts) < 2:
        raise InputError(f"calibration of {op.value}: need at least 2 measured sizes, got {len(pts)}")
    # A shared machine adds time to whole sizes now and then (a size whose samples were all
    # disturbed). First: a size much slower than some larger size was disturbed, since
    # moving more bytes does not get faster.
    keep, fastest_above = [], math.inf
    for x, y in reversed(pts):
        if y <= 1.5 * fastest_above:
            keep.append((x, y))
            fastest_above = min(fastest_above, y)
    keep.reverse()
    if len(keep) < 2:
        keep = pts
    fit = _fit_points(keep, op, n, max_segments, min_points, noise_floor)
    # Then: points far off that fit, by a robust scale; fit again without them.
    rel = [(fit.time(x) - y) / y for x, y in keep]
    scale = 1.4826 * statistics.median(abs(r) for r in rel)
    kept = [p for p, r in zip(keep, rel) if abs(r) <= max(5 * scale, outlier_floor)]
    if len(kept) < len(keep) and len(kept) >= max(2, len(pts) // 2):
        keep = kept
    if len(keep) < len(pts):
        fit = _fit_points(keep, op, n, max_segments, min_points, noise_floor)
        fit.outliers = [int(x) for x, y in pts if (x, y) not in keep]
    return fit


def _fit_points(pts, op: Op, n: int, max_segments: int, min_points: int, noise_floor: float) -> OpFit:
    s = [p[0] for p in pts]
    t = [p[1] for p in pts]
    m = len(s)
    kmax = max(1, min(max_segments, m // min_points))
    options = _segment_dp(s, t, kmax, min(min_points, m))
    # BIC on relative error; the floor keeps perfect synthetic data from rewarding extra segments.
    def bic(k: int) -> float:
        sse = max(options[k][0], m * noise_floor ** 2)
        return m * math.log(sse / m) + (3 * k - 1) * math.log(m)

    k = min(options, key=lambda k: (bic(k), k))
    starts = options[k][1] + [m]
    lines = []
    for i, j in zip(starts, starts[1:]):
        a, b, _ = fit_line(s[i:j], t[i:j])
        lines.append((a, b, i, j))
    bounds = [0.0]
    for (a1, b1, i1, j1), (a2, b2, i2, j2) in zip(lines, lines[1:]):
        left, right = s[j1 - 1], s[i2]
        cross = (a2 - a1) / (b1 - b2) if b1 != b2 else math.nan
        # A crossing inside the neighbouring points' span is where the library switches; else a jump.
        lo_ok = s[max(i1, j1 - 2)]
        hi_ok = s[min(j2 - 1, i2 + 1)]
        bounds.append(min(max(cross, left), right) if lo_ok <= cross <= hi_ok else math.sqrt(left * right))
    bounds.append(math.inf)
    big_l, big_f = ring_terms(op, n)
    segments = []
    for (a, b, i, j), lo, hi in zip(lines, bounds, bounds[1:]):
        alpha = a / big_l if big_l else 0.0
        bw = (big_f / b) if (b > 0 and big_f > 0) else math.inf
        segments.append(Segment(lo, hi, a, b, alpha, bw, j - i, int(s[i]), int(s[j - 1])))
    fit = OpFit(op.value, n, segments, 0.0, 0.0)
    rel = [(fit.time(x) - y) / y for x, y in zip(s, t)]
    fit.rms_rel_error = math.sqrt(sum(r * r for r in rel) / m)
    fit.max_rel_error = max(abs(r) for r in rel)
    return fit


# Ethernet frame (1514 B with a 1500 B MTU) per TCP payload (1448 B with timestamps): rate
# shapers count frames, collectives count payload.
WIRE_PER_PAYLOAD = 1514 / 1448


def link_estimate(fits: dict[str, OpFit]) -> dict[str, Any]:
    """The link rate the fits imply: the median over ops of the large-size bus bandwidth, as payload and as frames."""
    bws = {name: f.segments[-1].bandwidth_Bps for name, f in fits.items()
           if f.segments[-1].points >= 3 and not math.isinf(f.segments[-1].bandwidth_Bps)}
    if not bws:
        return {}
    # The median, not the best: a 3-point last segment of one op can overshoot.
    best = statistics.median(bws.values())
    return {"ops": sorted(bws), "payload_Bps": best, "wire_Bps": best * WIRE_PER_PAYLOAD,
            "all_reduce_payload_Bps": bws.get("all_reduce")}


