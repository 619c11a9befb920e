"""``nbox run``: the user's unmodified script as the real rank, every other rank emulated."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import List, Optional

import typer

from ..errors import InputError
from . import BANDWIDTH_SCALE, INJECT, LATENCY_SCALE, WORLD_SIZE, app, console, load


@app.command(
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
    no_args_is_help=True,
)
def run(
    topology: Path = typer.Argument(..., help="Topology YAML file."),
    command: List[str] = typer.Argument(None, help="The training command, after --, e.g. -- python train.py --epochs 1"),
    rank: Optional[int] = typer.Option(None, "--rank", help="Which rank is real (default: the topology's first real rank)."),
    model: Optional[str] = typer.Option(None, "-m", "--model", help="Delay model (default: the topology's)."),
    algorithm: Optional[str] = typer.Option(None, "-a", "--algorithm", help="Force an algorithm of the model."),
    inject: List[str] = INJECT,
    latency_scale: Optional[float] = LATENCY_SCALE,
    bandwidth_scale: Optional[float] = BANDWIDTH_SCALE,
    straggler: List[str] = typer.Option([], "--straggler", help="RANK=FACTOR: that rank computes FACTOR times slower."),
    world_size: Optional[int] = WORLD_SIZE,
    report: Optional[Path] = typer.Option(None, "--report", help="Write the run report (JSON) here."),
    trace: Optional[Path] = typer.Option(None, "--trace", help="Write a Chrome/Perfetto trace here."),
    warmup: Optional[int] = typer.Option(None, "--warmup", help="Iterations left out of the statistics (default 1 of 3+)."),
    quiet: bool = typer.Option(False, "-q", "--quiet", help="No summary at exit."),
    cluster: Optional[str] = typer.Option(None, "--cluster", help="Run the real rank in its node of this cluster (nbox up)."),
    mode: str = typer.Option(
        "model", "--mode", help="model (collectives end at modeled times) or wire (real bytes to stub peers; needs --cluster)."
    ),
    metrics_addr: Optional[str] = typer.Option(
        None, "--metrics-addr", help="Serve the real rank's Prometheus metrics on HOST:PORT (port 0: a free one)."
    ),
) -> None:
    """Run a training command as the real rank of TOPOLOGY; the rest of the cluster is emulated."""
    from ..emu.runner import run_command
    from ..model.registry import create_model
    from ..report.run_summary import summarize, summary_tables
    from ..report.trace import write_trace

    topo = load(topology, inject, latency_scale, bandwidth_scale, straggler, world_size)
    changes = {k: v for k, v in (("model", model), ("algorithm", algorithm)) if v is not None}
    if changes:
        topo = topo.with_changes(emulation=changes)
    create_model(topo)  # a bad model, algorithm or NCCL release fails here, before the script starts
    real = rank if rank is not None else topo.emulation.real_ranks[0]
    if warmup is not None and warmup < 0:
        raise InputError(f"--warmup: must be 0 or more, got {warmup}")
    if mode not in ("model", "wire"):
        raise InputError(f"--mode: expected model or wire, got {mode!r}")
    if mode == "wire" and not cluster:
        raise InputError("--mode wire needs --cluster NAME (a cluster brought up with `nbox up`)")
    from ..metrics.progress import RunProgress

    extra_env = {"NBOX_METRICS_ADDR": metrics_addr} if metrics_addr else {}
    with RunProgress(console, enabled=False if quiet else None):
        result = run_command(topo, command or [], real, cluster=cluster, mode=mode, extra_env=extra_env)
    if result.record is None:
        console.print("[yellow]nbox: the command made no torch.distributed calls: nothing was emulated[/yellow]")
    else:
        meta = {"topology": topo.name, "file": str(topology), "command": list(command or [])}
        rep = summarize(result.record, warmup, meta)
        if report:
            report.write_text(json.dumps(rep, indent=2) + "\n", encoding="utf-8")
        if trace:
            write_trace(rep, trace)
        if not quiet:
            for table in summary_tables(rep):
                console.print(table)
            for path in (report, trace):
                if path:
                    console.print(f"wrote {path}")
    if result.returncode != 0:
        print(f"nbox: error: the command exited with status {result.returncode}", file=sys.stderr)
        raise typer.Exit(1)
