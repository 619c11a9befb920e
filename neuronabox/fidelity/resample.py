"""How much one calibration's own samples let its figures move: bootstrap and split-half refits of a profile.

Timing two calibrations on a shared host mixes the calibration's noise with the host's; the
samples a profile keeps answer the first part alone. ``bootstrap`` redraws every size's samples
(with replacement) and ``halves`` splits them by sweep round (even and odd rounds, each spread
over the whole calibration, so a slow minute falls into both); ``refit`` settles and fits them
as ``nbox calibrate`` does, giving a profile the calibrated model reads. The spread of what
such profiles predict, and of the host-coupling figures redrawn the same way
(``figure_draws``), is how far a calibration can move from sampling alone.
"""

from __future__ import annotations

import copy
import random
import statistics
from typing import Any, Iterable

from ..collectives import Op
from ..model.profile import OpFit

__all__ = ["bootstrap", "halves", "refit", "figure_draws", "relative_sd", "spread"]


def bootstrap(measurements: dict[str, list[dict]], rng: random.Random) -> dict[str, list[dict]]:
    """The sweep rows with each size's samples drawn again, as many, with replacement."""
    out = {}
    for op, rows in measurements.items():
        out[op] = [dict(r, samples=[rng.choice(r["samples"]) for _ in r["samples"]]) if r.get("samples") else dict(r)
                   for r in rows]
    return out


def halves(measurements: dict[str, list[dict]]) -> tuple[dict[str, list[dict]], dict[str, list[dict]]]:
    """The sweep rows split by round (``per_pass`` samples a round): even rounds, odd rounds; a one-round size is in both."""
    parts: tuple[dict, dict] = ({}, {})
    for op, rows in measurements.items():
        for half in (0, 1):
            kept = []
            for r in rows:
                per = max(1, int(r.get("per_pass") or 1))
                rounds = [r["samples"][i:i + per] for i in range(0, len(r.get("samples") or []), per)]
                mine = [x for j, chunk in enumerate(rounds) if j % 2 == half or len(rounds) == 1 for x in chunk]
                kept.append(dict(r, samples=mine) if mine else dict(r))
            parts[half][op] = kept
    return parts


def refit(profile: dict[str, Any], measurements: dict[str, list[dict]], settle: bool = True) -> dict[str, Any]:
    """A copy of ``profile`` with these sweep rows, settled and fitted as ``nbox calibrate`` does; ``fits`` filled for the calibrated model.

    ``settle=False``: each size's time is its samples' median, as calibrations before ``settle_times`` had it.
    """
    from .calibrate import fit_measured, settle_times

    doc = copy.deepcopy({k: v for k, v in profile.items() if k not in ("measurements", "fits", "intra_fits")})
    measured = {"ops": copy.deepcopy(measurements)}
    if settle:
        settle_times(measured)
    else:
        for rows in measured["ops"].values():
            for r in rows:
                if r.get("samples"):
                    r["time_s"] = statistics.median(r["samples"])
    fits = fit_measured(measured, int(profile.get("ranks") or 2))
    doc["measurements"] = measured["ops"]
    doc["ops"] = {k: v.as_dict() for k, v in fits.items()}
    doc["fits"] = {Op.parse(k): OpFit.from_dict(v) for k, v in doc["ops"].items()}
    return doc


def figure_draws(profile: dict[str, Any], rng: random.Random, draws: int) -> dict[str, list[float]]:
    """Bootstrap draws of the host-coupling figures a profile keeps samples of: the busy rate (and stall), two-at-once over serial per size, spin-stall excess per cell."""
    out: dict[str, list[float]] = {}

    def redraw(xs: list) -> list:
        return [rng.choice(xs) for _ in xs]

    busy = profile.get("busy_progress") or {}
    if busy.get("rates"):
        out["busy_rate"] = [statistics.median(redraw(busy["rates"])) for _ in range(draws)]
    if busy.get("windows") and busy.get("idle_samples") and len(busy["windows"]) > 1:
        from .busy_stall import fit_windows

        fits = [fit_windows(statistics.median(redraw(busy["idle_samples"])),
                            [{**w, "samples": redraw(w["samples"]),
                              **({"idle_samples": redraw(w["idle_samples"])} if w.get("idle_samples") else {})}
                             for w in busy["windows"]])
                for _ in range(draws)]
        out["busy_stall_s"] = [f[0] for f in fits]
        out["busy_rate_after_stall"] = [f[1] for f in fits]
    for pt in (profile.get("concurrency") or {}).get("points") or []:
        if pt.get("single_samples") and pt.get("pair_samples"):
            out[f"pair_ratio_{pt['size']}"] = [
                statistics.median(redraw(pt["pair_samples"])) / (2 * statistics.median(redraw(pt["single_samples"])))
                for _ in range(draws)]
    for cell in (profile.get("spin_stall") or {}).get("cells") or []:
        walls = [s[0] for s in cell.get("samples") or []]
        if walls:
            out[f"stall_excess_{cell['size']}_{cell['gap_s'] * 1e3:g}ms"] = [
                statistics.median(redraw(walls)) for _ in range(draws)]
    return out


def relative_sd(values: Iterable[float]) -> float:
    """Standard deviation over the mean's magnitude (0 for fewer than two values or a zero mean)."""
    xs = list(values)
    if len(xs) < 2:
        return 0.0
    m = statistics.fmean(xs)
    return statistics.stdev(xs) / abs(m) if m else 0.0


def spread(values: Iterable[float]) -> float:
    """(max - min) over the median's magnitude."""
    xs = list(values)
    med = statistics.median(xs)
    return (max(xs) - min(xs)) / abs(med) if med else 0.0
