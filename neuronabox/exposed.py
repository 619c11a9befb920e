"""Exposed communication: the one rule behind every number that says "exposed".

The run summary and its per-op rows, the PNG, the report JSON (``report/``) and the Prometheus
counter (``metrics/exporter.py``) all read this rule, so they cannot disagree. Exposed is the
time the real rank waited on collectives instead of computing: ``wait()`` calls are measured;
waits inside C++ (DDP's reducer waiting on bucket futures at the end of backward) are not
visible to Python, so for ops nobody waited on in Python the exposed part is the stretch from
the iteration's last collective call to the last modeled completion before the iteration
ended — the tail that the next compute had to wait for.
"""

from __future__ import annotations

from typing import Sequence

__all__ = ["split"]


def split(calls: Sequence[tuple[float, float | None, float]], start: float, end: float) -> list[float]:
    """Seconds of exposed time charged to each call (enqueue, end, wait) of one iteration from ``start`` to ``end``.

    Each call is charged the time the real rank waited on it; the tail goes to the call that
    completed last among those nobody waited on (the next compute waited for it). The sum is
    the iteration's exposed time.
    """
    charged = [float(wait or 0.0) for _, _, wait in calls]
    unwaited = [k for k, (_, done, wait) in enumerate(calls) if not wait and done is not None]
    if unwaited:
        last = max(unwaited, key=lambda k: calls[k][1])
        last_call = max(enqueue for enqueue, _, _ in calls)
        charged[last] += max(0.0, min(calls[last][1], end) - max(last_call, start))
    return charged
