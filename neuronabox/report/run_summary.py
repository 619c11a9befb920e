"""What ``nbox run`` tells the user at exit: iteration time, time in collectives, exposed communication.

Input is the record the real rank writes (``neuronabox.launcher.child``): per-op enqueue, start and
end times (seconds since the recorder started), how long the caller blocked in ``wait()``, and
the iteration durations. Exposed communication follows the one rule of ``neuronabox.exposed``
(measured waits, plus the tail after the last call that DDP's reducer waits for in C++); each
op is charged its own waits and the tail goes to the op that completed last, so the per-op
rows add up to the total. The table, the per-op rows, the PNG (``plots.py``) and the report
JSON (``exposed_per_iteration``, ``exposed_ratio``, ``per_op[*].exposed_s``) all read it.
"""

from __future__ import annotations

import shlex
import statistics
from itertools import accumulate
from pathlib import Path
from typing import Any

from rich.table import Table

from ..exposed import split
from ..stats import percentile
from ..units import format_duration, format_size

__all__ = ["summarize", "summarize_ranks", "summary_tables", "exposed_split", "exposed_headline", "calls_text",
           "next_steps"]


def _stats(values: list[float]) -> dict[str, float]:
    if not values:
        return {"count": 0}
    return {
        "count": len(values),
        "median": statistics.median(values),
        "p95": percentile(values, 95),
        "mean": statistics.fmean(values),
        "min": min(values),
        "max": max(values),
    }


def exposed_split(ops: list[dict], start: float, end: float) -> list[float]:
    """Seconds of exposed communication charged to each of ``ops`` (one iteration's records, ``start`` to ``end``)."""
    return split([(o["enqueue"], o.get("end"), o["wait"]) for o in ops], start, end)


def _exposed(ops: list[dict], start: float, end: float) -> float:
    """Seconds the real rank waited on collectives between ``start`` and ``end``."""
    return sum(exposed_split(ops, start, end))


def summarize(record: dict[str, Any], warmup: int | None = None, meta: dict[str, Any] | None = None) -> dict[str, Any]:
    """The run report (JSON-ready) from the real rank's record; ``warmup`` iterations are left out of the statistics."""
    iterations: list[float] = list(record.get("device_iterations") or record.get("iterations") or [])
    ops: list[dict] = record.get("ops", [])
    n = len(iterations)
    if warmup is None:
        warmup = 1 if n >= 3 else 0  # the first iteration carries set-up (allocations, DDP buckets)
    warmup = min(warmup, max(0, n - 1))
    marks = [0.0] + list(accumulate(iterations))
    by_iter: dict[int, list[dict]] = {}
    for o in ops:
        by_iter.setdefault(o["iteration"], []).append(o)
    comm, exposed = [], []
    charged: dict[int, float] = {}  # id(op) -> its share of the exposed time
    for i in range(warmup, n):
        its = by_iter.get(i, [])
        comm.append(sum(o["duration"] for o in its))
        shares = exposed_split(its, marks[i], marks[i + 1]) if its else []
        charged.update((id(o), c) for o, c in zip(its, shares))
        exposed.append(sum(shares))
    measured = [o for o in ops if o["iteration"] >= warmup]
    per_op: dict[str, dict[str, Any]] = {}
    calls: dict[str, dict[int, int]] = {}  # op -> measured iteration -> calls in it
    for o in measured:
        s = per_op.setdefault(o["op"], {"count": 0, "bytes": 0, "modeled_s": 0.0, "waited_s": 0.0, "exposed_s": 0.0,
                                        "algorithms": {}})
        s["count"] += 1
        s["bytes"] += o["nbytes"]
        s["modeled_s"] += o["duration"]
        s["waited_s"] += o["wait"]
        s["exposed_s"] += charged.get(id(o), 0.0)
        s["algorithms"][o["algorithm"]] = s["algorithms"].get(o["algorithm"], 0) + 1
        if o["iteration"] < n:
            calls.setdefault(o["op"], {}).setdefault(o["iteration"], 0)
            calls[o["op"]][o["iteration"]] += 1
    for name, s in per_op.items():
        s["mean_duration_s"] = s["modeled_s"] / s["count"]
        # Calls per iteration mean something only for an op that every measured iteration makes
        # equally often (DDP's all-reduce); a one-off (the initial broadcast) is a total count.
        seen = calls.get(name, {})
        counts = set(seen.values())
        every = n > warmup and len(seen) == n - warmup and len(counts) == 1 and s["count"] == sum(seen.values())
        s["calls_per_iteration"] = counts.pop() if every else None
    lateness = [o["lateness"] for o in ops if o.get("lateness") is not None]
    timed = iterations[warmup:]
    roles = _roles(record.get("roles"), warmup, timed, exposed)
    return {
        **(meta or {}),
        "world_size": record.get("world_size"),
        "real_rank": record.get("real_rank"),
        "model": record.get("model"),
        "iterations": iterations,
        "warmup": warmup,
        "iteration_time": _stats(timed),
        "comm_modeled_per_iteration": _stats(comm),
        "exposed_per_iteration": _stats(exposed),
        "exposed_ratio": (sum(exposed) / sum(timed)) if timed and sum(timed) > 0 else 0.0,
        "per_op": per_op,
        "lateness": _stats(lateness),
        "communicators": record.get("communicators", {}),
        **({"hardware": record["hardware"]} if record.get("hardware") else {}),
        **({"nccl_env": record["nccl_env"]} if record.get("nccl_env") else {}),
        **({"host_effects": record["host_effects"]} if record.get("host_effects") else {}),
        **({"roles": roles} if roles else {}),
        "ops": ops,
    }


def _roles(replayed: dict[str, Any] | None, warmup: int, timed: list[float], exposed: list[float]) -> dict[str, Any]:
    """Per role (replay.py): its rank, whether it ran for real, iteration time and bubble (waiting) per iteration."""
    if not replayed:
        return {}
    real = replayed.get("_real", {})
    out: dict[str, Any] = {}
    if real:
        # The real rank's waits are measured whole: they hold its bubble and its exposed communication.
        out[real["role"]] = {"rank": real["rank"], "real": True, "iteration_time": _stats(timed),
                             "waiting_per_iteration": _stats(exposed)}
    for name, r in replayed.items():
        if name.startswith("_"):
            continue
        # An actor's iterations run from mark to mark: its first one ends at index 1 of the real rank's.
        its = r["iterations"]
        waited, bubble = r["waited"][warmup:], r["bubble"][warmup:]
        out[name] = {"rank": r["rank"], "real": False, "iteration_time": _stats(its[max(0, warmup - 1):]),
                     "waiting_per_iteration": _stats(waited), "bubble_per_iteration": _stats(bubble),
                     "exposed_per_iteration": _stats([w - b for w, b in zip(waited, bubble)]),
                     "events_replayed": f"{r['events_replayed']} of {r['events']}",
                     "marks": r.get("marks", []), "calls": r.get("calls", [])}
    if replayed.get("_forced"):
        out["_forced_ops"] = replayed["_forced"]
    return out


def summarize_ranks(
    records: dict[int, dict[str, Any]], warmup: int | None = None, meta: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The report of several real ranks: each one's under ``ranks`` (by world rank), and the spread of medians.

    The top level is the first real rank's report, so whatever reads a one-rank report (``nbox
    report``, the trace, the plots) reads this one as the first real rank's.
    """
    ranks = {r: summarize(records[r], warmup, None) for r in sorted(records)}
    medians = {r: rep["iteration_time"].get("median") for r, rep in ranks.items()}
    known = [m for m in medians.values() if m is not None]
    spread: dict[str, Any] = {"medians": {str(r): m for r, m in medians.items()}}
    if known:
        lo, hi = min(known), max(known)
        spread.update(min=lo, max=hi, relative=(hi - lo) / lo if lo > 0 else 0.0)
    first = ranks[min(ranks)] if ranks else {}
    return {
        **(meta or {}),
        **first,
        "real_ranks": sorted(ranks),
        "iteration_time_spread": spread,
        "ranks": {str(r): rep for r, rep in ranks.items()},
    }


def _rank_tables(report: dict[str, Any]) -> list[Table]:
    """The exit summary of several real ranks: the run, one row per real rank, the first rank's collectives."""
    ranks = report["ranks"]
    t = Table(title="nbox run", show_header=False, title_justify="left")
    t.add_column("what", style="bold")
    t.add_column("value")
    if report.get("topology"):
        t.add_row("topology", f"{report['topology']} ({report.get('file', '')})")
    real = report["real_ranks"]
    listed = ", ".join(map(str, real))
    t.add_row("world", f"{report['world_size']} ranks, {len(real)} real ({listed}), model {report['model']}")
    _hardware_rows(t, report)
    sp = report["iteration_time_spread"]
    if "relative" in sp:
        t.add_row("iteration time",
                  f"medians {_t(sp['min'])} - {_t(sp['max'])} across real ranks, spread {sp['relative']:.2%}")
    per = Table(title="real ranks (measured iterations)", title_justify="left")
    for col in ("rank", "iterations", "median", "p95", "mean", "in collectives", "exposed"):
        per.add_column(col, justify="right")
    for r, rep in ranks.items():
        it, comm = rep["iteration_time"], rep["comm_modeled_per_iteration"]
        per.add_row(
            r, f"{it.get('count', 0)} of {len(rep['iterations'])}", _t(it.get("median")), _t(it.get("p95")),
            _t(it.get("mean")), _t(comm.get("median")), f"{rep['exposed_ratio']:.1%}",
        )
    first = ranks[str(real[0])] if real else None
    return [t, per] + (summary_tables(first)[1:] if first else [])


def _hardware_rows(t: Table, report: dict[str, Any]) -> None:
    """The nccl model's hardware profile, the error it showed against measurements, and the NCCL_* limits it took."""
    for i, line in enumerate(report.get("hardware") or ()):
        t.add_row("hardware" if i == 0 else "", f"profile {line}" if i == 0 else line)
    if report.get("nccl_env"):
        t.add_row("NCCL environment", " ".join(report["nccl_env"]))


def _t(seconds: float | None) -> str:
    return "-" if seconds is None or seconds != seconds else format_duration(seconds)


def exposed_headline(report: dict[str, Any]) -> str:
    """The run's exposed communication in words: the same text in the summary table and the PNG's title."""
    med = report.get("exposed_per_iteration", {}).get("median")
    return f"{report.get('exposed_ratio', 0.0):.1%} of the measured time (median {_t(med)} per iteration)"


def calls_text(s: dict[str, Any]) -> str:
    """An op's calls: per iteration when every measured iteration makes it equally often, else the total."""
    per = s.get("calls_per_iteration")
    if per is not None:
        return f"{per} per iteration"
    return f"{s['count']} in total"


def next_steps(report: dict[str, Any], report_path: str | None = None) -> str:
    """The line after the summary: the commands worth trying next on this run."""
    topo = report.get("file") or "TOPOLOGY.yaml"
    cmd = shlex.join(report.get("command") or []) or "python train.py"
    if report_path:
        draw = f"nbox report {shlex.quote(str(report_path))} --png {shlex.quote(str(Path(report_path).with_suffix('.png')))}"
    else:
        draw = f"nbox run {shlex.quote(topo)} --report run.json -- {cmd}; nbox report run.json --png run.png"
    return f"next: {draw}  |  nbox whatif {shlex.quote(topo)} --sweep bandwidth_scale=0.5,1,2 -- {cmd}"


def summary_tables(report: dict[str, Any]) -> list[Table]:
    """The exit summary as rich tables: the run, then one row per collective type (per real rank first, if several)."""
    if "ranks" in report:
        return _rank_tables(report)
    it, comm = report["iteration_time"], report["comm_modeled_per_iteration"]
    t = Table(title="nbox run", show_header=False, title_justify="left")
    t.add_column("what", style="bold")
    t.add_column("value")
    if report.get("topology"):
        t.add_row("topology", f"{report['topology']} ({report.get('file', '')})")
    t.add_row("world", f"{report['world_size']} ranks, real rank {report['real_rank']}, model {report['model']}")
    _hardware_rows(t, report)
    total = len(report["iterations"])
    t.add_row("iterations", f"{it.get('count', 0)} measured ({report['warmup']} warm-up of {total} left out)")
    if it.get("count"):
        t.add_row("iteration time", f"median {_t(it['median'])}, p95 {_t(it['p95'])}, mean {_t(it['mean'])}")
        t.add_row("in collectives", f"median {_t(comm.get('median'))} per iteration (modeled; overlapping "
                  "collectives each count, so this can exceed the iteration)")
        t.add_row("exposed comm", exposed_headline(report) + ": the real rank waited, not computing")
    for i, line in enumerate(report.get("host_effects") or ()):
        t.add_row("host effects" if i == 0 else "", line)
    lat = report["lateness"]
    if lat.get("count"):
        t.add_row("lateness", f"p50 {_t(lat['median'])}, p95 {_t(lat['p95'])}, max {_t(lat['max'])} "
                  "(emulator overshoot: completion signalled after the modeled end)")
    ops = Table(title="collectives (measured iterations)", title_justify="left",
                caption="exposed: the op's share of the exposed comm above (the rows add up to it)",
                caption_justify="left")
    for col in ("op", "calls", "bytes", "modeled", "mean", "exposed", "algorithm"):
        ops.add_column(col, justify="left" if col in ("op", "algorithm") else "right")
    for name, s in sorted(report["per_op"].items(), key=lambda kv: -kv[1]["modeled_s"]):
        algos = ", ".join(f"{a}" + (f" x{c}" if len(s["algorithms"]) > 1 else "") for a, c in s["algorithms"].items())
        ops.add_row(
            name, calls_text(s), format_size(s["bytes"]), _t(s["modeled_s"]), _t(s["mean_duration_s"]),
            _t(s.get("exposed_s", s["waited_s"])), algos,
        )
    tables = [t, ops] if report["per_op"] else [t]
    if report.get("roles"):
        tables.append(_roles_table(report["roles"]))
    return tables


def _roles_table(roles: dict[str, Any]) -> Table:
    """One row per role: the real rank's measured, the others' replayed from their programs."""
    t = Table(title="roles (measured iterations; medians per iteration)", title_justify="left")
    for col in ("role", "rank", "runs", "iteration", "waiting", "bubble", "exposed comm"):
        t.add_column(col, justify="left" if col in ("role", "runs") else "right")
    for name, r in roles.items():
        if name.startswith("_"):
            continue
        it, wait = r["iteration_time"].get("median"), r["waiting_per_iteration"].get("median")
        share = f" ({wait / it:.0%})" if it and wait is not None else ""
        bub = r.get("bubble_per_iteration", {}).get("median")
        exp = r.get("exposed_per_iteration", {}).get("median")
        # The real rank's waits are not split: which part waited for a replayed rank is the model's.
        t.add_row(name, str(r["rank"]), "real" if r["real"] else "replayed", _t(it), _t(wait) + share,
                  _t(bub) if not r["real"] else "-", _t(exp) if not r["real"] else "-")
    return t
