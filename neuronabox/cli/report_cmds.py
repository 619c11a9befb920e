"""``nbox report``: a run report (``nbox run --report``) as the summary tables and a PNG."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from ..errors import InputError
from . import app, console

_NEEDED = ("iterations", "ops", "per_op", "iteration_time")


def _read_json(path: Path):
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise InputError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"{path}: cannot read: {exc}") from None
    except json.JSONDecodeError as exc:
        raise InputError(f"{path}: not JSON ({exc.msg} at line {exc.lineno})") from None


def load_report(path: Path, data=None) -> dict:
    """Read and check a run report; InputError (exit 2) names the file and what is wrong."""
    data = _read_json(path) if data is None else data
    missing = [k for k in _NEEDED if not isinstance(data, dict) or k not in data]
    if missing:
        raise InputError(
            f"{path}: not an nbox run report (no {', '.join(missing)}); write one with `nbox run --report FILE`"
        )
    return data


@app.command("report", no_args_is_help=True)
def report_cmd(
    run_json: Path = typer.Argument(
        ..., help="A run report written by `nbox run --report`, or a sweep's whatif.json (`nbox whatif`: draws its "
        "plots again, beside it)."),
    png: Optional[Path] = typer.Option(
        None, "--png", help="Write the picture here (default: the report's name with .png)."
    ),
    no_png: bool = typer.Option(False, "--no-png", help="Print the summary only."),
    iteration: Optional[int] = typer.Option(
        None, "--iteration", help="Draw this iteration (default: the median measured one)."
    ),
) -> None:
    """Print a run's summary and draw one iteration's timeline and the per-op breakdown (PNG)."""
    from ..fidelity import whatif
    from ..report.run_summary import summary_tables

    data = _read_json(run_json)
    if isinstance(data, dict) and data.get("format") == whatif.FORMAT:
        _sweep_report(run_json, data, png, no_png)
        return
    rep = load_report(run_json, data)
    n = len(rep["iterations"])
    if iteration is not None and not 0 <= iteration < n:
        raise InputError(
            f"--iteration: {iteration} is not in 0-{n - 1}" if n else "--iteration: the run has no iterations"
        )
    for table in summary_tables(rep):
        console.print(table)
    if no_png:
        return
    from ..report.plots import plot_run

    out = png or run_json.with_suffix(".png")
    try:
        plot_run(rep, out, iteration)
    except OSError as exc:
        raise InputError(f"--png: cannot write {out}: {exc.strerror or exc}") from None
    console.print(f"wrote {out}")


def _sweep_report(path: Path, doc: dict, png: Optional[Path], no_png: bool) -> None:
    """A what-if sweep's table, and its plots drawn again beside its whatif.json (a sweep draws one PNG per knob)."""
    from ..fidelity.whatif import load_outputs, write_plots

    if png is not None:
        raise InputError(f"--png: {path} is a what-if sweep, whose plots (one per knob) go beside it")
    results, knobs, context = load_outputs(path, doc)
    table = path.with_name("whatif.md")
    if table.is_file():
        console.print(table.read_text(encoding="utf-8"))
    if no_png:
        return
    try:
        written = write_plots(results, knobs, path.parent, context)
    except OSError as exc:
        raise InputError(f"{path.parent}: cannot write the plots: {exc.strerror or exc}") from None
    for out in written:
        console.print(f"wrote {out}")
