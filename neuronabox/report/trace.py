"""A Chrome / Perfetto trace of a run: the real rank's iterations, the emulated collectives, each replayed role.

Open it in https://ui.perfetto.dev or chrome://tracing. Times are microseconds since the
recorder started. One process is the real rank (its iterations), one process holds the
emulated collectives with a thread per communicator, so FIFO order and overlap are visible.
With role profiles (replay.py), each replayed role has a process of its own: its iterations
and its calls, each from its arrival to the op's end (the part before the op started is time
it waited for other ranks).
"""

from __future__ import annotations

import json
from itertools import accumulate
from pathlib import Path
from typing import Any

__all__ = ["chrome_trace", "write_trace"]

_REAL, _EMULATED, _ROLES = 1, 2, 10


def _meta(pid: int, tid: int | None, name: str, kind: str) -> dict[str, Any]:
    event = {"ph": "M", "pid": pid, "name": kind, "args": {"name": name}}
    if tid is not None:
        event["tid"] = tid
    return event


def chrome_trace(report: dict[str, Any]) -> dict[str, Any]:
    """The trace document for a run report (``run_summary.summarize``)."""
    events: list[dict[str, Any]] = [
        _meta(_REAL, None, f"real rank {report.get('real_rank')}", "process_name"),
        _meta(_REAL, 1, "iterations", "thread_name"),
        _meta(_EMULATED, None, f"emulated collectives ({report.get('world_size')} ranks, {report.get('model')})", "process_name"),
    ]
    marks = [0.0] + list(accumulate(report.get("iterations", [])))
    for i, (a, b) in enumerate(zip(marks, marks[1:])):
        events.append({"ph": "X", "pid": _REAL, "tid": 1, "name": f"iteration {i}", "ts": a * 1e6, "dur": (b - a) * 1e6,
                       "args": {"warm-up": i < report.get("warmup", 0)}})
    comms = sorted({o["comm"] for o in report.get("ops", [])})
    tids = {c: k + 1 for k, c in enumerate(comms)}
    sizes = report.get("communicators", {})
    for c, tid in tids.items():
        events.append(_meta(_EMULATED, tid, f"{c} ({len(sizes.get(c, [])) or '?'} ranks)", "thread_name"))
    for o in report.get("ops", []):
        if o.get("start") is None or o.get("end") is None:
            continue
        args = {"bytes": o["nbytes"], "ranks": o["ranks"], "algorithm": o["algorithm"], "iteration": o["iteration"],
                "queued_us": (o["start"] - o["enqueue"]) * 1e6, "waited_us": o["wait"] * 1e6}
        if o.get("extra"):
            args["straggler_us"] = o["extra"] * 1e6
        events.append({"ph": "X", "pid": _EMULATED, "tid": tids[o["comm"]], "name": o["op"], "cat": "collective",
                       "ts": o["start"] * 1e6, "dur": (o["end"] - o["start"]) * 1e6, "args": args})
        events.append({"ph": "i", "s": "t", "pid": _REAL, "tid": 1, "name": f"call {o['op']}", "ts": o["enqueue"] * 1e6})
    events += _role_tracks(report.get("roles") or {})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def _role_tracks(roles: dict[str, Any]) -> list[dict[str, Any]]:
    """A process per replayed role: its iterations, and each call from its arrival to the op's end."""
    events: list[dict[str, Any]] = []
    replayed = [(name, r) for name, r in roles.items() if not name.startswith("_") and not r.get("real")]
    for k, (name, r) in enumerate(replayed):
        pid = _ROLES + k
        events += [_meta(pid, None, f"role {name} (rank {r['rank']}, replayed)", "process_name"),
                   _meta(pid, 1, "iterations", "thread_name"), _meta(pid, 2, "calls", "thread_name")]
        marks = r.get("marks", [])
        for i, (a, b) in enumerate(zip(marks, marks[1:]), 1):
            events.append({"ph": "X", "pid": pid, "tid": 1, "name": f"iteration {i}", "ts": a * 1e6,
                           "dur": (b - a) * 1e6})
        for op, arrive, start, end in r.get("calls", []):
            events.append({"ph": "X", "pid": pid, "tid": 2, "name": op, "cat": "replayed", "ts": arrive * 1e6,
                           "dur": max(0.0, end - arrive) * 1e6, "args": {"waited_for_peers_us": (start - arrive) * 1e6,
                                                                          "transfer_us": (end - start) * 1e6}})
    return events


def write_trace(report: dict[str, Any], path: str | Path) -> None:
    """Write the trace JSON."""
    Path(path).write_text(json.dumps(chrome_trace(report)), encoding="utf-8")
