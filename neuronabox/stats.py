"""Order statistics and intervals used by reports, validation and benchmarks."""

from __future__ import annotations

import random
import statistics
from typing import Sequence

__all__ = ["percentile", "error_interval"]


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100) by nearest rank; NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = max(0, min(len(ordered) - 1, int(round(q / 100.0 * (len(ordered) - 1)))))
    return ordered[k]


def error_interval(real_runs: Sequence[float], emu_runs: Sequence[float], draws: int = 2000,
                   seed: int = 1) -> tuple[float, float] | None:
    """95% bootstrap interval of the emulated/real error of the median, resampling whole runs (their medians) of each system.

    Whole runs, because iterations of one run are not independent (a slow run is slow
    throughout). Seeded: the same runs give the same interval. None below two runs a side.
    """
    if len(real_runs) < 2 or len(emu_runs) < 2:
        return None
    rng = random.Random(seed)
    errs = sorted(statistics.median(rng.choices(emu_runs, k=len(emu_runs)))
                  / statistics.median(rng.choices(real_runs, k=len(real_runs))) - 1 for _ in range(draws))
    return errs[int(0.025 * draws)], errs[int(0.975 * draws) - 1]
