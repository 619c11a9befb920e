"""What ``nbox validate`` found: each system's iteration times, its error against the real one, a verdict.

Apart from how the runs are made (``validate.py``), so the table can be recomputed and tested
from iteration times alone: ``compare`` fills medians, each error with its 95% bootstrap
interval over whole runs, and a verdict against the tolerance, read beside the real system's
own run-to-run spread and its error against itself (``real-again``, this machine's noise
floor); ``error_table`` lays it out as rows of text.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

from ..stats import error_interval, percentile

__all__ = ["AGAIN", "ModeResult", "Validation", "UNDECIDED", "UNDECIDED_WHY", "compare", "error_table"]

# real-again: the real system a second time, interleaved like a mode; its error is this machine's
# noise alone (an A/A comparison), the floor an emulator's error is read against. It never gates.
AGAIN = "real-again"


@dataclass
class ModeResult:
    """One system's iteration times over all repeats, and how they compare with the real system."""

    mode: str
    available: bool = True
    why: str = ""
    runs: list[list[float]] = field(default_factory=list)  # per repeat, the measured iterations (s)
    median_s: float | None = None
    p95_s: float | None = None
    run_medians_s: list[float] = field(default_factory=list)
    error: float | None = None  # (median - real median) / real median
    interval: tuple[float, float] | None = None  # the error's 95% bootstrap interval over whole runs
    verdict: str = ""
    failed: str = ""  # why its runs did not finish (the mode then fails the validation)


@dataclass
class Validation:
    """The error table and everything it was computed from."""

    topology: str
    command: list[str]
    iterations: int
    warmup: int
    repeats: int
    tolerance: float
    real: ModeResult
    modes: list[ModeResult]
    real_spread: float | None  # (max - min) / median of the real system's per-run medians
    model: str | None = None
    profile: str | None = None
    seconds: float = 0.0
    twin_ranks: list[int] = field(default_factory=list)  # the load twin's ranks (empty: no twin)
    against: list[str] = field(default_factory=list)  # nbox record folders read as the real system

    @property
    def passed(self) -> bool:
        """Every available mode within the tolerance."""
        return all(m.error is not None and abs(m.error) <= self.tolerance
                   for m in self.modes if m.available and m.mode != AGAIN)

    def floor_note(self) -> str | None:
        """A line when the real system missed the tolerance against itself (real-again), else None."""
        again = next((m for m in self.modes if m.mode == AGAIN and m.error is not None), None)
        if again is None or abs(again.error) <= self.tolerance:
            return None
        return (f"{AGAIN}: the real system read {again.error:+.2%} against itself, past the tolerance "
                f"{self.tolerance:.2%}: on this machine these runs cannot show an emulator within it")

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form (``--json``)."""
        d = asdict(self)
        d["passed"] = self.passed
        return d


# A verdict's note where the error's interval crosses the tolerance (UNDECIDED_WHY says it in full).
UNDECIDED = "undecided"
UNDECIDED_WHY = "undecided: the error's 95% interval crosses the tolerance; more --repeats narrow it"


def _fill(m: ModeResult) -> None:
    pooled = [t for run in m.runs for t in run]
    if pooled:
        m.median_s = statistics.median(pooled)
        m.p95_s = percentile(pooled, 95)
        m.run_medians_s = [statistics.median(r) for r in m.runs if r]


def compare(real: ModeResult, modes: Sequence[ModeResult], tolerance: float) -> float | None:
    """Fill in medians, errors and verdicts; returns the real system's run-to-run spread."""
    _fill(real)
    spread = None
    if len(real.run_medians_s) >= 2 and real.median_s:
        spread = (max(real.run_medians_s) - min(real.run_medians_s)) / statistics.median(real.run_medians_s)
    again = next((m for m in modes if m.mode == AGAIN), None)
    if again is not None:
        _fill(again)
        if again.median_s is not None and real.median_s:
            again.error = (again.median_s - real.median_s) / real.median_s
            again.interval = error_interval(real.run_medians_s, again.run_medians_s)
        again.verdict = "the real system against itself: what a perfect emulator would read here"
    for m in modes:
        if m is again:
            continue
        if not m.available:
            m.verdict = "not available"
            continue
        if m.failed:
            m.verdict = f"FAIL: {m.failed}"
            continue
        _fill(m)
        if m.median_s is None or not real.median_s:
            m.verdict = "no data"
            continue
        m.error = (m.median_s - real.median_s) / real.median_s
        m.interval = error_interval(real.run_medians_s, m.run_medians_s)
        ok = abs(m.error) <= tolerance
        notes = []
        if spread is not None and abs(m.error) <= spread:
            notes.append("within the real spread")
        if again is not None and again.error is not None and abs(m.error) <= abs(again.error):
            notes.append(f"within {AGAIN}'s")
        lo, hi = m.interval or (m.error, m.error)
        if (lo < -tolerance or hi > tolerance) and lo <= tolerance and hi >= -tolerance:
            # The gate still follows the median; this says whether more runs could change it.
            notes.append(UNDECIDED)
        m.verdict = ("pass" if ok else "FAIL") + (f" ({'; '.join(notes)})" if notes else "")
    return spread


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1e3:.2f}"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v * 100:+.2f}%"


def error_table(v: Validation) -> list[list[str]]:
    """The error table as rows of text: a header, the real system, then one row per mode."""
    rows = [["system", "median (ms)", "p95 (ms)", "error of median", "95% interval", "real spread", "verdict"]]
    spread = "-" if v.real_spread is None else f"{v.real_spread * 100:.2f}%"
    rows.append(["real", _ms(v.real.median_s), _ms(v.real.p95_s), "", "", spread, f"{len(v.real.runs)} runs"])
    for m in v.modes:
        if not m.available:
            rows.append([m.mode, "-", "-", "-", "-", spread, f"not available: {m.why}"])
        elif m.failed:
            rows.append([m.mode, "-", "-", "-", "-", spread, m.verdict])
        else:
            ci = "-" if m.interval is None else f"{m.interval[0] * 100:+.1f}..{m.interval[1] * 100:+.1f}%"
            rows.append([m.mode, _ms(m.median_s), _ms(m.p95_s), _pct(m.error), ci, spread, m.verdict])
    return rows
