"""Verbs about topologies and models: schema, show, models, bench."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import List, Optional

import typer

from ..errors import InputError
from . import BANDWIDTH_SCALE, INJECT, LATENCY_SCALE, WORLD_SIZE, app, console, load


@app.command()
def schema(output: Optional[Path] = typer.Option(None, "-o", "--output", help="Write here instead of stdout.")) -> None:
    """Print the JSON Schema of topology files."""
    from ..topology.schema import json_schema

    text = json.dumps(json_schema(), indent=2) + "\n"
    if output:
        output.write_text(text, encoding="utf-8")
        console.print(f"wrote {output}")
    else:
        sys.stdout.write(text)


@app.command()
def show(
    topology: Path = typer.Argument(..., help="Topology YAML file."),
    png: Optional[Path] = typer.Option(None, "--png", help="Draw the graph into this PNG file."),
    dot: Optional[Path] = typer.Option(None, "--dot", help="Write the graph as Graphviz dot."),
    route: List[str] = typer.Option([], "--route", help="Print the route between two ranks, e.g. 0:9 (repeatable)."),
    world_size: Optional[int] = WORLD_SIZE,
) -> None:
    """Summarize a topology; optionally draw it or print routes."""
    topo = load(topology, world_size=world_size)  # before the graph's imports: bad input is refused sooner
    from ..report.topology_view import check_drawable, route_table, summary_tables, write_dot, write_png
    from ..topology.graph import ClusterGraph

    pairs = []
    for spec in route:  # all checked before anything is printed
        src, sep, dst = spec.partition(":")
        if not (sep and src.isdigit() and dst.isdigit()) or max(int(src), int(dst)) >= topo.world_size:
            raise InputError(f"--route: expected SRC:DST ranks within 0-{topo.world_size - 1}, got {spec!r}")
        pairs.append((int(src), int(dst)))
    graph = ClusterGraph(topo)
    for flag, wanted in (("--dot", dot), ("--png", png)):
        if wanted:
            check_drawable(graph, flag)
    for table in summary_tables(topo, graph):
        console.print(table)
    for src, dst in pairs:
        console.print(route_table(graph, src, dst))
    if dot:
        write_dot(graph, dot)
        console.print(f"wrote {dot}")
    if png:
        write_png(graph, png)
        console.print(f"wrote {png}")


@app.command()
def models() -> None:
    """List the delay models (built-in and plugins) and their algorithms."""
    from rich.table import Table

    from ..model.registry import available_models, model_class

    t = Table(title="delay models", title_justify="left")
    for col in ("name", "source", "algorithms", "description"):
        t.add_column(col)
    for name, source in available_models().items():
        try:
            cls = model_class(name)
            t.add_row(name, source, ", ".join(("auto",) + cls.algorithms), cls.description)
        except InputError as exc:
            t.add_row(name, source, "-", f"[red]{exc}[/red]")
    console.print(t)


@app.command()
def bench(
    topology: Path = typer.Argument(..., help="Topology YAML file."),
    op: Optional[str] = typer.Option(
        None, "-o", "--op", help="Collective, or 'all' (default all_reduce; with --compare, the log's)."
    ),
    minbytes: str = typer.Option("8", "-b", "--minbytes", help="Smallest size (8, 1K, 64MiB)."),
    maxbytes: str = typer.Option("128M", "-e", "--maxbytes", help="Largest size."),
    stepfactor: float = typer.Option(2.0, "-f", "--stepfactor", help="Multiply the size by this each row."),
    stepbytes: Optional[str] = typer.Option(None, "-i", "--stepbytes", help="Add this to the size each row instead."),
    model: Optional[str] = typer.Option(None, "-m", "--model", help="Delay model (default: the topology's)."),
    profile: Optional[Path] = typer.Option(
        None, "--profile", help="Calibration profile (nbox calibrate) over emulation.profile; selects model calibrated."
    ),
    algorithm: Optional[str] = typer.Option(None, "-a", "--algorithm", help="Force an algorithm."),
    protocol: Optional[str] = typer.Option(None, "-p", "--protocol", help="Force a protocol (nccl model)."),
    ranks: Optional[str] = typer.Option(None, "--ranks", help="The communicator, e.g. 0-7,16 (default: every rank)."),
    dtype: str = typer.Option("float", "-d", "--datatype", help="Element type: " + ", ".join(["int8", "half", "bfloat16", "float", "double"])),
    root: int = typer.Option(0, "-r", "--root", help="Root (index in the communicator) of rooted collectives."),
    json_out: Optional[str] = typer.Option(None, "--json", help="Write the rows as JSON to this file ('-' for stdout)."),
    inject: List[str] = INJECT,
    latency_scale: Optional[float] = LATENCY_SCALE,
    bandwidth_scale: Optional[float] = BANDWIDTH_SCALE,
    world_size: Optional[int] = WORLD_SIZE,
    compare: List[Path] = typer.Option(
        [], "--compare", help="nccl-tests output file (repeatable): the model at its sizes beside it, with the error per size."
    ),
) -> None:
    """The nccl-tests table, from the model: time, algbw and busbw per size."""
    topo = load(topology, inject, latency_scale, bandwidth_scale, (), world_size)  # before the model's imports
    from ..collectives import Op
    from ..model.bench import DTYPES, parse_bench_size, parse_ranks, run_bench, sweep_sizes
    from ..model.calibrated import with_profile
    from ..model.nccl_env import from_environment
    from ..model.registry import create_model
    from ..report.nccl_tests import format_table

    topo = with_profile(topo, profile, model)
    # nccl-tests on the cluster runs under the job's NCCL_ALGO / NCCL_PROTO / NCCL_NVLS_ENABLE; so does the nccl model.
    topo, taken = from_environment(topo, os.environ)
    env_note = [f"NCCL environment: {' '.join(taken)}"] if taken else []
    try:
        ops = list(Op) if op == "all" else [Op.parse(op or "all_reduce")]
    except ValueError as exc:
        raise InputError(f"--op: {exc}") from None
    if compare:
        # A named op is checked against each log's own (a log of another collective is refused); else the log says.
        _compare(topo, compare, model, ops[0] if op and op != "all" else None, env_note)
        return
    if dtype not in DTYPES:
        raise InputError(f"--datatype: unknown type {dtype!r} (choose from {', '.join(DTYPES)})")
    sizes = sweep_sizes(
        parse_bench_size(minbytes, "--minbytes"), parse_bench_size(maxbytes, "--maxbytes"), stepfactor,
        parse_bench_size(stepbytes, "--stepbytes") if stepbytes is not None else None,
    )
    group = parse_ranks(ranks, topo.world_size) if ranks else parse_ranks(f"0-{topo.world_size - 1}", topo.world_size)
    if not 0 <= root < group.size:
        raise InputError(f"--root: {root} is not an index in a communicator of {group.size} ranks")
    m = create_model(topo, model, algorithm=algorithm, protocol=protocol)
    rows = run_bench(m, ops, sizes, group, dtype, root)
    if json_out:
        doc = {
            "topology": topo.name, "file": topo.source, "model": m.name, "algorithm": m.algorithm,
            "ranks": group.size, "world_size": topo.world_size, "rows": [r.as_dict() for r in rows],
        }
        text = json.dumps(doc, indent=2) + "\n"
        if json_out == "-":
            sys.stdout.write(text)
            return
        Path(json_out).write_text(text, encoding="utf-8")
    header = [
        f"nbox bench: topology {topo.name} ({topo.source}), {group.size} of {topo.world_size} ranks "
        f"on {len({topo.rank_node[r] for r in group.ranks})} nodes",
        f"model {m.name}, algorithm {m.algorithm}" + (f", protocol {m.protocol}" if m.protocol not in ("", "auto") else "")
        + (f", hardware profile {hw}" if (hw := getattr(getattr(m, "inner", m), "hardware_source", "")) else "")
        + _channel_bounds(topo),
        *_accuracy_notes(m),
        *env_note,
        f"minBytes {sizes[0]} maxBytes {sizes[-1]} step: {stepbytes or f'{stepfactor:g}(factor)'}",
    ]
    for i, o in enumerate(ops):
        sys.stdout.write(format_table([r for r in rows if r.op == o.value], header if i == 0 else []) + "\n\n")
    if json_out:
        console.print(f"wrote {json_out}")


def _accuracy_notes(m) -> list[str]:
    """What error the hardware profiles behind the model's times showed against published measurements."""
    notes = getattr(getattr(m, "inner", m), "accuracy_notes", None)
    return notes() if notes else []


def _channel_bounds(topo) -> str:
    """The header's note of the channel bounds the topology sets (NCCL_MIN_CTAS / NCCL_MAX_CTAS), if any."""
    em = topo.emulation
    parts = [f"{k} {v}" for k, v in (("min_channels", em.min_channels), ("max_channels", em.max_channels)) if v]
    return f", {', '.join(parts)}" if parts else ""


def _compare(topo, logs: List[Path], model: Optional[str], op=None, env_note: List[str] = ()) -> None:
    """``bench --compare``: the topology's model at each log's sizes, beside the log."""
    from ..fidelity.hardware_fit import compare_rows, measured_points
    from ..fidelity.nccl_log import read_log
    from ..model.registry import create_model
    from ..report.nccl_tests import ROUGH, format_compare

    m = create_model(topo, model)
    for path in logs:
        measured = measured_points(topo, read_log(path, op, default_ranks=topo.world_size))
        timer, log_env = m, []
        if measured.nccl_env and getattr(getattr(m, "inner", m), "name", "") == "nccl":
            # The log's own NCCL_ALGO / NCCL_PROTO (NCCL_DEBUG=INFO lines) limited that run: so do they its model.
            timer = create_model(measured.topology, model)
            log_env = ["the log's NCCL environment: " + " ".join(measured.nccl_env)]
        inner = getattr(timer, "inner", timer)
        rows = compare_rows(measured, use_topology=True, model=timer)
        where = getattr(inner, "hardware_source", "")
        head = [f"nbox bench --compare: topology {topo.name} ({topo.source}), {measured.log.ranks} ranks on "
                f"{measured.n_nodes} node(s)", f"log {path}: {measured.log.op.value}"
                + (f", NCCL {measured.log.nccl_version}" if measured.log.nccl_version else ""),
                f"model {m.name}" + (f", hardware profile {where}" if where else "") + _channel_bounds(topo),
                *_accuracy_notes(timer), *env_note, *log_env]
        sys.stdout.write(format_compare(rows, head, measured.log.timing_gaps(ROUGH)) + "\n\n")
