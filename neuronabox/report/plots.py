"""The run report as a picture: one iteration's timeline, the per-op breakdown, iteration times over the run.

Input is the report JSON of ``nbox run --report`` (``run_summary.summarize``): per-op call,
start and end times in seconds since the recorder started, waits, iteration durations.
Exposed communication follows ``run_summary``'s rule, so the numbers in the picture are the
numbers in the summary table: waits measured in Python, plus, for ops nobody waited on in
Python (DDP's reducer waits in C++), the stretch from the iteration's last collective call to
the last modeled completion before the iteration ended.

Layout decisions (the picture must read at a glance): one lane for the real rank (compute in
blue, exposed waiting in red), one lane per communicator with each collective coloured by op
and its FIFO queueing drawn as a thin line before it; times in ms from the iteration start.
"""

from __future__ import annotations

import statistics
from itertools import accumulate
from pathlib import Path
from typing import Any

from ..units import format_bandwidth, format_duration, format_size
from .run_summary import calls_text, exposed_headline, exposed_split

__all__ = ["median_iteration", "iteration_layout", "plot_run", "suptitle", "OP_COLORS"]

# Fixed colours per op, so every picture (and the dashboard's legend order) agrees.
OP_COLORS = {
    "all_reduce": "#1f77b4",
    "all_gather": "#2ca02c",
    "reduce_scatter": "#ff7f0e",
    "broadcast": "#9467bd",
    "reduce": "#8c564b",
    "all_to_all": "#e377c2",
    "gather": "#17becf",
    "scatter": "#bcbd22",
    "send_recv": "#7f7f7f",
    "barrier": "#393b79",
}
COMPUTE = "#9ecae1"
_LATE = "completed late (emulator overshoot)"
EXPOSED = "#d62728"


def _marks(report: dict[str, Any]) -> list[float]:
    return [0.0] + list(accumulate(report.get("iterations") or []))


def median_iteration(report: dict[str, Any]) -> int | None:
    """The measured iteration (warm-up left out) whose duration is the median; None for a run without iterations."""
    its = report.get("iterations") or []
    if not its:
        return None
    warmup = min(report.get("warmup", 0), len(its) - 1)
    measured = list(range(warmup, len(its)))
    med = statistics.median_low([its[i] for i in measured])
    return next(i for i in measured if its[i] == med)


def _merge(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(intervals):
        if b <= a:
            continue
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def iteration_layout(report: dict[str, Any], index: int) -> dict[str, Any]:
    """What the timeline of iteration ``index`` shows: span, compute and exposed intervals, ops per communicator."""
    marks = _marks(report)
    start, end = marks[index], marks[index + 1]
    ops = [o for o in report.get("ops", []) if o["iteration"] == index]
    exposed_iv: list[tuple[float, float]] = []
    for o in ops:
        if o["wait"] and o.get("end") is not None:
            done = o["end"] + (o.get("lateness") or 0.0)
            exposed_iv.append((max(start, done - o["wait"]), min(end, done)))
    unwaited = [o["end"] for o in ops if not o["wait"] and o.get("end") is not None]
    if unwaited:
        last_call = max(o["enqueue"] for o in ops)
        a, b = max(last_call, start), min(max(unwaited), end)
        if b > a:
            exposed_iv.append((a, b))
    exposed_iv = _merge(exposed_iv)
    compute, t = [], start
    for a, b in exposed_iv:
        if a > t:
            compute.append((t, a))
        t = max(t, b)
    if t < end:
        compute.append((t, end))
    lanes: dict[str, list[dict]] = {}
    for o in sorted(ops, key=lambda o: o["seq"]):
        lanes.setdefault(o["comm"], []).append(o)
    timed = [o for o in ops if o.get("start") is not None and o.get("end") is not None]
    lo = min([start] + [o["enqueue"] for o in ops])
    hi = max([end] + [o["end"] for o in timed])
    return {
        "index": index,
        "start": start,
        "end": end,
        "duration": end - start,
        "exposed": sum(exposed_split(ops, start, end)),  # run_summary's number, by run_summary's rule
        "exposed_intervals": exposed_iv,
        "compute_intervals": compute,
        "lanes": dict(sorted(lanes.items())),
        "xlim": (lo, hi),
        "ops": ops,
    }


def _exposed_per_iteration(report: dict[str, Any]) -> list[float]:
    return [iteration_layout(report, i)["exposed"] for i in range(len(report.get("iterations") or []))]


def _ms(x: float) -> float:
    return x * 1e3


def suptitle(report: dict[str, Any]) -> str:
    """The picture's title: the run, and its exposed communication as the summary table words it."""
    head = (f"{report.get('topology') or 'run'} — {report.get('world_size')} ranks, "
            f"real rank {report.get('real_rank')}, model {report.get('model')}")
    if not report.get("iteration_time", {}).get("count"):
        return head
    return f"{head}\nexposed communication: {exposed_headline(report)}"


def plot_run(report: dict[str, Any], path: str | Path, iteration: int | None = None, dpi: int = 130) -> Path:
    """Write the report's picture (PNG) to ``path``; ``iteration`` defaults to the median measured one."""
    import matplotlib

    matplotlib.use("Agg")  # files only: never needs a display
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    path = Path(path)
    its = report.get("iterations") or []
    index = median_iteration(report) if iteration is None else iteration
    if index is not None and not 0 <= index < len(its):
        raise ValueError(f"iteration {index} is not in 0-{len(its) - 1}")
    lanes_n = len(iteration_layout(report, index)["lanes"]) if index is not None else 0
    fig = plt.figure(figsize=(13, 6.2 + 0.45 * lanes_n), dpi=dpi, layout="constrained")
    top_h = 1.6 + 0.5 * lanes_n
    gs = fig.add_gridspec(2, 2, height_ratios=[top_h, 3.2], width_ratios=[1.25, 1])
    ax_t = fig.add_subplot(gs[0, :])
    ax_ops = fig.add_subplot(gs[1, 0])
    ax_it = fig.add_subplot(gs[1, 1])
    fig.suptitle(suptitle(report), fontsize=13, fontweight="bold")

    used_ops: set[str] = set()
    if index is None:
        ax_t.text(0.5, 0.5, "no iterations recorded", ha="center", va="center", transform=ax_t.transAxes)
        ax_t.set_axis_off()
    else:
        used_ops = _timeline(ax_t, report, iteration_layout(report, index), index)
    _breakdown(ax_ops, report, index)
    _iterations(ax_it, report)
    handles = [Patch(color=COMPUTE, label="real rank: compute"),
               Patch(color=EXPOSED, label="real rank: waiting (exposed comm)")]
    handles += [Patch(color=OP_COLORS.get(op, "#555555"), label=op) for op in sorted(used_ops - {_LATE})]
    if _LATE in used_ops:
        handles.append(Patch(facecolor="none", edgecolor="#444444", hatch="////", label=_LATE))
    ax_t.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8.5, frameon=False)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


def _timeline(ax, report: dict[str, Any], lay: dict[str, Any], index: int) -> set[str]:
    t0 = lay["start"]
    lanes = list(lay["lanes"].items())
    sizes = report.get("communicators", {})
    n = len(lanes) + 1
    y_of = {comm: n - 2 - k for k, (comm, _) in enumerate(lanes)}
    ry = n - 1  # the real rank on top
    h = 0.62
    for a, b in lay["compute_intervals"]:
        ax.broken_barh([(_ms(a - t0), _ms(b - a))], (ry - h / 2, h), facecolors=COMPUTE, edgecolor="white", lw=0.5)
    for a, b in lay["exposed_intervals"]:
        ax.broken_barh([(_ms(a - t0), _ms(b - a))], (ry - h / 2, h), facecolors=EXPOSED, edgecolor="white", lw=0.5)
    span_ms = _ms(lay["xlim"][1] - lay["xlim"][0]) or 1.0
    used: set[str] = set()
    for comm, ops in lanes:
        y = y_of[comm]
        for o in ops:
            if o.get("start") is None or o.get("end") is None:
                continue
            used.add(o["op"])
            color = OP_COLORS.get(o["op"], "#555555")
            if o["start"] > o["enqueue"]:  # FIFO queueing behind the communicator's previous op
                ax.plot([_ms(o["enqueue"] - t0), _ms(o["start"] - t0)], [y, y], color="#888888", linewidth=1, zorder=1)
            ax.plot([_ms(o["enqueue"] - t0)], [y + h / 2 + 0.04], marker="v", markersize=3.5, color="#444444", zorder=3)
            w = _ms(o["end"] - o["start"])
            ax.broken_barh([(_ms(o["start"] - t0), max(w, span_ms * 0.002))], (y - h / 2, h), facecolors=color,
                           edgecolor="black", linewidth=0.4, zorder=2)
            late = o.get("lateness") or 0.0
            if _ms(late) > span_ms * 0.005:
                # The emulator signalled completion after the modeled end: the caller's wait includes it.
                ax.broken_barh([(_ms(o["end"] - t0), _ms(late))], (y - h / 2, h), facecolors="none", edgecolor=color,
                               hatch="////", linewidth=0.6, zorder=2)
                used.add(_LATE)
            if w > span_ms * 0.07:
                ax.text(_ms(o["start"] - t0) + w / 2, y, f"{o['op']}\n{format_size(o['nbytes'])}", ha="center",
                        va="center", fontsize=7, color="white", zorder=4, clip_on=True)
    labels = {ry: "real rank"}
    for comm, ops in lanes:
        ranks = len(sizes.get(comm, [])) or (ops[0]["ranks"] if ops else "?")
        labels[y_of[comm]] = f"{comm} ({ranks} ranks)"
    ax.set_yticks(sorted(labels), [labels[k] for k in sorted(labels)], fontsize=9)
    ax.set_ylim(-0.6, n - 0.4)
    lo, hi = lay["xlim"]
    pad = (hi - lo) * 0.01
    ax.set_xlim(_ms(lo - t0 - pad), _ms(hi - t0 + pad))
    ax.axvline(0, color="black", linewidth=0.8)
    ax.axvline(_ms(lay["end"] - t0), color="black", linewidth=0.8, linestyle="--")
    ax.set_xlabel("ms since the iteration started  (▼ = the real rank called the collective; "
                  "grey line = queued behind the previous op)", fontsize=8.5)
    ax.grid(axis="x", alpha=0.3)
    d = lay["duration"]
    exp = lay["exposed"]
    comm_s = sum(o["duration"] for o in lay["ops"])
    kind = "median" if index == median_iteration(report) else "chosen"
    ax.set_title(
        f"Iteration {index} ({kind} of {len(report.get('iterations', []))}): {format_duration(d)} — "
        f"compute {format_duration(max(0.0, d - exp))}, exposed in this iteration {format_duration(exp)} "
        f"({exp / d:.0%}), {len(lay['ops'])} collectives, {format_duration(comm_s)} modeled",
        fontsize=10.5, loc="left",
    )
    return used


def _breakdown(ax, report: dict[str, Any], index: int | None) -> None:
    per_op = report.get("per_op") or {}
    measured = max(1, report.get("iteration_time", {}).get("count", 0) or len(report.get("iterations", [])))
    ax.set_title("Per-op breakdown (modeled time per measured iteration)", fontsize=10.5, loc="left")
    if not per_op:
        ax.text(0.5, 0.5, "no collectives", ha="center", va="center", transform=ax.transAxes)
        ax.set_axis_off()
        return
    rows = sorted(per_op.items(), key=lambda kv: kv[1]["modeled_s"])
    names = [k for k, _ in rows]
    per_it = [_ms(s["modeled_s"] / measured) for _, s in rows]
    ax.barh(names, per_it, color=[OP_COLORS.get(k, "#555555") for k in names], edgecolor="black", linewidth=0.4)
    xmax = max(per_it) if per_it else 1.0
    it_med = report.get("iteration_time", {}).get("median")
    exp_med = report.get("exposed_per_iteration", {}).get("median")
    refs = []
    if it_med:
        ax.axvline(_ms(it_med), color="black", linestyle="--", linewidth=1)
        refs.append(_ms(it_med))
    if exp_med:
        ax.axvline(_ms(exp_med), color=EXPOSED, linestyle="--", linewidth=1)
        refs.append(_ms(exp_med))
    right = max([xmax] + refs) * 1.02
    for y, (name, s) in enumerate(rows):
        algos = s.get("algorithms", {})
        total = sum(algos.values()) or 1
        algo_text = " ".join(
            a if len(algos) == 1 else f"{a} {c / total:.0%}" for a, c in sorted(algos.items(), key=lambda kv: -kv[1])
        )
        bw = s["bytes"] / s["modeled_s"] if s["modeled_s"] > 0 else 0.0
        # A one-off op (not in every iteration alike) says its total, not a fraction of a call per iteration.
        size = (f"{format_size(s['bytes'] / measured)}/iter" if s.get("calls_per_iteration") is not None
                else f"{format_size(s['bytes'])}")
        text = (f"{calls_text(s).replace(' per iteration', '/iter')} · {size} · "
                f"{format_bandwidth(bw, bits=False)} algbw · {algo_text}")
        ax.text(per_it[y] + right * 0.01, y, text, va="center", fontsize=8,
                bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.85, "pad": 1.5})
    ax.set_xlim(0, right * 1.9)  # room for the annotations right of the bars
    handles = []
    from matplotlib.lines import Line2D

    if it_med:
        handles.append(Line2D([], [], color="black", ls="--", label=f"median iteration {format_duration(it_med)}"))
    if exp_med:
        handles.append(Line2D([], [], color=EXPOSED, ls="--", label=f"median exposed {format_duration(exp_med)}"))
    if handles:
        ax.legend(handles=handles, loc="lower right", fontsize=8, frameon=False)
    ax.set_xlabel("ms per iteration", fontsize=9)
    ax.grid(axis="x", alpha=0.3)


def _iterations(ax, report: dict[str, Any]) -> None:
    its = report.get("iterations") or []
    ax.set_title("Iteration time over the run", fontsize=10.5, loc="left")
    if not its:
        ax.text(0.5, 0.5, "no iterations", ha="center", va="center", transform=ax.transAxes)
        return
    warmup = report.get("warmup", 0)
    exposed = _exposed_per_iteration(report)
    xs = list(range(len(its)))
    total = [_ms(v) for v in its]
    exp = [_ms(min(e, v)) for e, v in zip(exposed, its)]
    comp = [t - e for t, e in zip(total, exp)]
    colors = ["#cccccc" if i < warmup else COMPUTE for i in xs]
    ax.bar(xs, comp, color=colors, width=0.85)
    ax.bar(xs, exp, bottom=comp, color=[("#f2a0a0" if i < warmup else EXPOSED) for i in xs], width=0.85)
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    handles = [Patch(color=COMPUTE, label="compute"), Patch(color=EXPOSED, label="exposed comm")]
    if warmup:
        handles.append(Patch(color="#cccccc", label="warm-up"))
    med = report.get("iteration_time", {}).get("median")
    if med:
        ax.axhline(_ms(med), color="black", linestyle="--", linewidth=1)
        handles.append(Line2D([], [], color="black", linestyle="--", label=f"median {format_duration(med)}"))
    measured = total[warmup:] or total
    # Warm-up iterations (allocation, DDP set-up) can be 30x longer: clip so the steady state
    # reads, and leave headroom for the legend above the bars.
    top = max(measured) * 1.5
    ax.set_ylim(0, top)
    for i, v in enumerate(total):
        if v > top:
            ax.text(i, top * 0.97, f"{v:.0f} ms ↑", ha="center", va="top", fontsize=7, rotation=90)
    ax.set_xlabel("iteration" + (f" (first {warmup} grey: warm-up, left out of the statistics)" if warmup else ""),
                  fontsize=8.5)
    ax.set_ylabel("ms", fontsize=9)
    ax.legend(handles=handles, loc="upper right", ncol=2, fontsize=8, frameon=True, framealpha=0.9)
    ax.grid(axis="y", alpha=0.3)
