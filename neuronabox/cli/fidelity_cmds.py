"""Verbs about fidelity and what-if studies: whatif (validate and calibrate join later)."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from ..errors import InputError
from . import app, console, load


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True}, no_args_is_help=True)
def whatif(
    topology: Path = typer.Argument(..., help="Topology YAML file."),
    command: List[str] = typer.Argument(None, help="The training command, after --."),
    sweep: List[str] = typer.Option([], "--sweep", help="KNOB=V1,V2,...: inject.OP, latency_scale, bandwidth_scale, "
                                    "world_size, straggler.RANK, model, topology (repeatable: the grid is their product)."),
    repeats: int = typer.Option(1, "--repeats", help="Runs per grid point (interleaved)."),
    warmup: Optional[int] = typer.Option(None, "--warmup", help="Iterations left out of each run's statistics."),
    out: Path = typer.Option(Path("whatif-out"), "-o", "--out", help="Folder for the CSV, Markdown table and PNGs."),
) -> None:
    """Run the training command over a grid of what-if knobs; write a CSV, a Markdown table and plots."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from ..fidelity.whatif import grid, parse_sweep, run_sweep, write_outputs

    if not sweep:
        raise InputError("--sweep: give at least one knob, e.g. --sweep inject.all_reduce=0ms,2ms,5ms")
    if repeats < 1:
        raise InputError(f"--repeats: must be 1 or more, got {repeats}")
    if not command:
        raise InputError("nbox whatif: no command to run (usage: nbox whatif TOPOLOGY --sweep K=V,.. -- python train.py)")
    base = load(topology)
    knobs = [parse_sweep(s) for s in sweep]
    points = grid(knobs)
    with Progress(TextColumn("[bold]what-if"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TextColumn("{task.description}"), console=console, transient=False) as bar:
        task = bar.add_task("", total=len(points) * repeats)

        def progress(done, total, point, _):
            bar.update(task, completed=done, description=", ".join(f"{k}={v}" for k, v in point.items()))

        results = run_sweep(base, knobs, command, repeats, warmup, progress)
    for path in write_outputs(results, knobs, out):
        console.print(f"wrote {path}")
    console.print((out / "whatif.md").read_text())
