"""``nbox whatif``: run a training command over a grid of what-if knobs and tabulate the answers.

A knob is ``NAME=V1,V2,...``:

- ``inject.OP`` (``inject.all_reduce=0ms,2ms,5ms``; plain ``inject`` means all_reduce): extra latency per collective
- ``latency_scale``, ``bandwidth_scale``: multiply every latency / network bandwidth
- ``world_size``: grow or shrink the cluster
- ``straggler.RANK`` (``straggler.3=1,1.5,2``): that rank computes this many times slower
- ``model``: the delay model; ``topology``: another topology file

The grid is the cartesian product; every point is one ``nbox run`` of the command, repeated
``repeats`` times (the median of the run medians is reported).
"""

from __future__ import annotations

import csv
import itertools
import json
import statistics
import textwrap
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from ..collectives import Op
from ..errors import InputError, NboxError, RunFailed
from ..jsondoc import read_document
from ..topology import Topology, load_topology
from ..units import UnitError, parse_duration

__all__ = ["Knob", "parse_sweep", "grid", "apply_point", "WhatIfResult", "prepare_points", "run_sweep",
           "write_outputs", "write_plots", "load_outputs", "FORMAT"]

FORMAT = "neuronabox-whatif/1"


@dataclass(frozen=True)
class Knob:
    """One swept knob: its name as written, and its values as written."""

    name: str
    values: tuple[str, ...]


def _numbers(values: tuple[str, ...], kind, what: str) -> list:
    """The values as numbers of ``kind``; the first that is not one is named."""
    out = []
    for v in values:
        try:
            out.append(kind(v))
        except ValueError:
            raise ValueError(f"{v!r} is not {what}") from None
    return out


def parse_sweep(spec: str) -> Knob:
    """``inject.all_reduce=0ms,2ms`` -> Knob; errors name the flag and the value."""
    name, sep, values = spec.partition("=")
    name = name.strip()
    vals = tuple(v.strip() for v in values.split(",") if v.strip())
    if not sep or not name or not vals:
        raise InputError(f"--sweep: expected KNOB=V1,V2,... (e.g. inject.all_reduce=0ms,2ms), got {spec!r}")
    if name == "inject":
        name = "inject.all_reduce"
    head, _, tail = name.partition(".")
    try:
        if head == "inject":
            Op.parse(tail)
            for v in vals:
                parse_duration(v.lstrip("+"))
        elif head in ("latency_scale", "bandwidth_scale"):
            if any(x <= 0 for x in _numbers(vals, float, "a number")):
                raise ValueError("scales must be greater than zero")
        elif head == "world_size":
            if any(x < 1 for x in _numbers(vals, int, "a whole number")):
                raise ValueError("world sizes must be positive")
        elif head == "straggler":
            if not tail.isdigit():
                raise ValueError("a straggler knob names its rank: straggler.RANK=F1,F2,... (e.g. straggler.3=1,1.5,2)")
            if any(x <= 0 for x in _numbers(vals, float, "a number")):
                raise ValueError("straggler factors must be greater than zero")
        elif head == "topology":
            for v in vals:
                if not Path(v).is_file():
                    raise ValueError(f"no such topology file {v!r}")
        elif head != "model":
            raise ValueError(
                f"unknown knob {name!r} (inject.OP, latency_scale, bandwidth_scale, world_size, straggler.RANK, model, topology)"
            )
    except (ValueError, UnitError) as exc:
        raise InputError(f"--sweep {spec!r}: {exc}") from None
    return Knob(name, vals)


def grid(knobs: Sequence[Knob]) -> list[dict[str, str]]:
    """Every combination of the knobs' values, in order."""
    names = [k.name for k in knobs]
    if len(set(names)) != len(names):
        raise InputError(f"--sweep: a knob is swept twice ({', '.join(names)})")
    return [dict(zip(names, combo)) for combo in itertools.product(*(k.values for k in knobs))]


def apply_point(base: Topology, point: dict[str, str]) -> tuple[Topology, str | None]:
    """The topology (and model name, if swept) of one grid point."""
    topo = load_topology(point["topology"]) if "topology" in point else base
    whatif: dict[str, Any] = {}
    inject = {k.value: f"{v}s" for k, v in topo.whatif.inject.items()}
    stragglers = dict(topo.whatif.stragglers)
    for name, value in point.items():
        head, _, tail = name.partition(".")
        if head == "inject":
            inject[Op.parse(tail).value] = value.lstrip("+")
        elif head in ("latency_scale", "bandwidth_scale"):
            whatif[head] = float(value)
        elif head == "world_size":
            whatif[head] = int(value)
        elif head == "straggler":
            stragglers[int(tail)] = float(value)
    whatif["inject"] = inject
    whatif["stragglers"] = stragglers
    return topo.with_changes(whatif=whatif), point.get("model")


@dataclass
class WhatIfResult:
    """One grid point's answer."""

    point: dict[str, str]
    iteration_median_s: float
    iteration_p95_s: float
    exposed_median_s: float
    comm_median_s: float
    runs: list[float] = field(default_factory=list)


def prepare_points(
    base: Topology, knobs: Sequence[Knob], profile: Path | None = None
) -> list[tuple[dict[str, str], Topology]]:
    """Every grid point with its topology, each checked (its model built) before anything runs.

    ``profile`` (``--profile``) applies to every point, those of a ``topology`` knob too; a
    ``model`` knob still picks its model for its points (the profile serves the calibrated ones).
    A point the topology cannot take fails here, its error led by the point (``--sweep world_size=3: ...``).
    """
    from ..model.calibrated import with_profile
    from ..model.registry import create_model

    prepared = []
    for p in grid(knobs):
        try:
            topo, model = apply_point(base, p)
            if profile is not None and "topology" in p:
                topo = with_profile(topo, profile)
            if model:
                topo = topo.with_changes(emulation={"model": model})
            create_model(topo)
        except InputError as exc:
            raise InputError(f"--sweep {', '.join(f'{k}={v}' for k, v in p.items())}: {exc}") from None
        prepared.append((p, topo))
    return prepared


class SweepStopped(NboxError):
    """nbox whatif was stopped (SIGINT, SIGTERM) during a run: the results of the points that finished."""

    def __init__(self, signal_name: str, results: list["WhatIfResult"], done: int, total: int):
        import signal

        self.exit_code = 128 + int(getattr(signal, signal_name))
        self.results, self.signal_name, self.done, self.total = results, signal_name, done, total
        super().__init__(f"stopped by {signal_name} after {done} of {total} runs")


def run_sweep(
    prepared: Sequence[tuple[dict[str, str], Topology]],
    command: Sequence[str],
    repeats: int = 1,
    warmup: int | None = None,
    progress: Callable[[int, int, dict[str, str], WhatIfResult | None], None] | None = None,
) -> list[WhatIfResult]:
    """Run the command at every prepared point (repeats interleaved across the grid, so drift hits all points alike)."""
    from ..launcher.runner import describe_exit, run_command
    from ..report.run_summary import summarize

    reports: list[list[dict]] = [[] for _ in prepared]
    total, done = len(prepared) * repeats, 0
    for _ in range(repeats):
        for i, (p, topo) in enumerate(prepared):
            res = run_command(topo, command, topo.emulation.real_ranks[0])
            if res.stopped_by:
                # Ctrl-C or SIGTERM in an hours-long sweep: what finished is kept.
                raise SweepStopped(res.stopped_by, _aggregate(prepared, reports), done, total)
            if res.returncode != 0:
                raise RunFailed(f"whatif point {p}: the command {describe_exit(res.returncode)}")
            if res.record is None:
                raise RunFailed(f"whatif point {p}: the command made no torch.distributed calls: nothing was emulated")
            reports[i].append(summarize(res.record, warmup))
            done += 1
            if progress:
                progress(done, total, p, None)
    return _aggregate(prepared, reports)


def _aggregate(prepared: Sequence[tuple[dict[str, str], Topology]], reports: list[list[dict]]) -> list[WhatIfResult]:
    """One result per point that has run, over its runs' summaries."""
    results = []
    for (p, _), reps in zip(prepared, reports):
        if not reps:
            continue
        med = [r["iteration_time"]["median"] for r in reps]
        results.append(
            WhatIfResult(
                point=p,
                iteration_median_s=statistics.median(med),
                iteration_p95_s=statistics.median(r["iteration_time"]["p95"] for r in reps),
                exposed_median_s=statistics.median(r["exposed_per_iteration"]["median"] for r in reps),
                comm_median_s=statistics.median(r["comm_modeled_per_iteration"]["median"] for r in reps),
                runs=med,
            )
        )
    return results


def _numeric(value: str) -> float | None:
    try:
        return parse_duration(value.lstrip("+")) * 1e3  # durations plot in ms
    except UnitError:
        pass
    try:
        return float(value)
    except ValueError:
        return None


# Under the table: what its columns are, and why "in collectives" may exceed the iteration.
COLUMNS_NOTE = (
    "iteration: median and p95 of the measured iterations; exposed comm: the time the real rank waited on "
    "collectives instead of computing (median per iteration); in collectives: the modeled time of all "
    "collectives of an iteration added up (median). Collectives overlap compute and each other (DDP's buckets, "
    "several communicators), so time in collectives can exceed the iteration; only the exposed part lengthens it."
)


def write_outputs(results: Sequence[WhatIfResult], knobs: Sequence[Knob], out: Path, context: str = "") -> list[Path]:
    """CSV, Markdown table, ``whatif.json`` and one PNG per knob (iteration time and communication versus the knob).

    ``context`` (topology, world, model, runs per point) goes under each plot's title.
    """
    out.mkdir(parents=True, exist_ok=True)
    names = [k.name for k in knobs]
    written = []
    csv_path = out / "whatif.csv"
    with csv_path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(names + ["iteration_median_ms", "iteration_p95_ms", "exposed_median_ms", "comm_modeled_median_ms", "runs"])
        for r in results:
            w.writerow([r.point[n] for n in names] + [f"{r.iteration_median_s * 1e3:.3f}", f"{r.iteration_p95_s * 1e3:.3f}",
                        f"{r.exposed_median_s * 1e3:.3f}", f"{r.comm_median_s * 1e3:.3f}", len(r.runs)])
    written.append(csv_path)
    md = out / "whatif.md"
    lines = ["| " + " | ".join(names) + " | iteration median (ms) | p95 (ms) | exposed comm (ms) | in collectives (ms) |",
             "|" + "---|" * len(names) + "---:|---:|---:|---:|"]
    for r in results:
        lines.append("| " + " | ".join(r.point[n] for n in names) + f" | {r.iteration_median_s * 1e3:.2f} | "
                     f"{r.iteration_p95_s * 1e3:.2f} | {r.exposed_median_s * 1e3:.2f} | {r.comm_median_s * 1e3:.2f} |")
    md.write_text("\n".join(lines) + "\n\n" + COLUMNS_NOTE + "\n")
    written.append(md)
    doc = {"format": FORMAT, "context": context, "knobs": [{"name": k.name, "values": list(k.values)} for k in knobs],
           "results": [asdict(r) for r in results]}
    js = out / "whatif.json"
    js.write_text(json.dumps(doc, indent=1) + "\n")
    written.append(js)
    try:
        written += write_plots(results, knobs, out, context)
    except ModuleNotFoundError as exc:
        # A dependency, missing only where the package went in without its dependencies (a
        # lent GPU machine with no index): the tables stand, whatif.json can be drawn elsewhere.
        if exc.name != "matplotlib":
            raise
    return written


def load_outputs(path: Path, doc: dict | None = None) -> tuple[list[WhatIfResult], list[Knob], str]:
    """The results, knobs and context of an earlier sweep from its ``whatif.json`` (``doc``: its JSON, already read)."""
    if doc is None:
        doc = read_document(path, str(path), FORMAT, "nbox whatif writes whatif.json in its --out folder")
    try:
        knobs = [Knob(k["name"], tuple(k["values"])) for k in doc["knobs"]]
        results = [WhatIfResult(**r) for r in doc["results"]]
    except (KeyError, TypeError) as exc:
        raise InputError(f"{path}: knobs/results: {exc}") from None
    return results, knobs, str(doc.get("context", ""))


def write_plots(results: Sequence[WhatIfResult], knobs: Sequence[Knob], out: Path, context: str = "") -> list[Path]:
    """One PNG per knob: iteration time, and exposed and in-collective communication, versus the knob."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for knob in knobs:
        others = [k.name for k in knobs if k.name != knob.name]
        series: dict[tuple, list[WhatIfResult]] = {}
        for r in results:
            series.setdefault(tuple(r.point[o] for o in others), []).append(r)
        numeric = all(_numeric(v) is not None for v in knob.values)
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.8))
        colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
        single = len(series) == 1
        for n, (key, rs) in enumerate(series.items()):
            color = colors[n % len(colors)]
            xs = [(_numeric(r.point[knob.name]) if numeric else i) for i, r in enumerate(rs)]
            label = ", ".join(f"{o}={v}" for o, v in zip(others, key))
            ys = [r.iteration_median_s * 1e3 for r in rs]
            ax1.plot(xs, ys, "o-", color=color, label=label or "iteration time (median)")
            if any(len(r.runs) > 1 for r in rs):
                # The spread of the repeats' medians: how much of a step is noise.
                lo = [y - min(r.runs) * 1e3 for y, r in zip(ys, rs)]
                hi = [max(r.runs) * 1e3 - y for y, r in zip(ys, rs)]
                ax1.errorbar(xs, ys, yerr=[lo, hi], fmt="none", ecolor=color, capsize=3, alpha=0.7)
            ax2.plot(xs, [r.exposed_median_s * 1e3 for r in rs], "s-", color=color,
                     label=f"exposed{': ' + label if label else ''}")
            # Time inside collectives, beside the exposed part: the gap between them is what
            # overlap with compute hides.
            ax2.plot(xs, [r.comm_median_s * 1e3 for r in rs], "^:", color=color, alpha=0.8,
                     label=f"in collectives{': ' + label if label else ''}")
            if numeric and single and len(rs) > 1:
                # The no-overlap bound: every ms the knob adds inside collectives shows up in the
                # iteration. A curve below it means part of the added time was hidden.
                base_it, base_comm = rs[0].iteration_median_s * 1e3, rs[0].comm_median_s * 1e3
                ax1.plot(xs, [base_it + (r.comm_median_s * 1e3 - base_comm) for r in rs], "--", color="gray",
                         label="no overlap: base + added collective time")
                ax1.axhline(base_it, color="gray", lw=0.8, ls=":", label="fully hidden: base")
        unit = " (ms)" if knob.name.startswith("inject") else ""
        for ax, what in ((ax1, "iteration time (ms, median)"), (ax2, "communication (ms per iteration, median)")):
            ax.set_xlabel(knob.name + unit)
            ax.set_ylabel(what)
            ax.grid(alpha=0.3)
            ax.set_ylim(bottom=0)
            if numeric:
                ticks = sorted({_numeric(v) for v in knob.values})
                ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
            else:
                ax.set_xticks(range(len(knob.values)), knob.values)
            ax.legend(fontsize=8, loc="best")  # where it hides the least: the curves sit high or low
        ax1.set_title("iteration time", fontsize=10)
        ax2.set_title("exposed vs inside collectives", fontsize=10)
        # The context (topology, model, command) runs longer than the figure is wide: wrapped, not clipped.
        fig.suptitle(f"what-if: {knob.name}" + (f"\n{textwrap.fill(context, 130)}" if context else ""), fontsize=10)
        fig.text(0.01, 0.01, "in collectives: every collective's modeled time added up; they overlap compute and each "
                 "other, so it can exceed the iteration. Only the exposed part lengthens the iteration.",
                 fontsize=8, color="#444444")
        fig.tight_layout(rect=(0, 0.04, 1, 1))
        path = out / f"whatif_{knob.name.replace('.', '_')}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths
