"""Verbs about fidelity and what-if studies: whatif, validate, calibrate."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import List, Optional

import typer

from ..errors import InputError
from ..fidelity.calibrate import DEFAULT_SIZES
from . import app, console, load


@app.command(no_args_is_help=True)  # no ignore_unknown_options: see run_cmd.py
def whatif(
    topology: Path = typer.Argument(..., help="Topology YAML file."),
    command: List[str] = typer.Argument(None, help="The training command, after --."),
    sweep: List[str] = typer.Option([], "--sweep", help="KNOB=V1,V2,...: inject.OP, latency_scale, bandwidth_scale, "
                                    "world_size, straggler.RANK, model, topology (repeatable: the grid is their product)."),
    repeats: int = typer.Option(1, "--repeats", help="Runs per grid point (interleaved)."),
    warmup: Optional[int] = typer.Option(None, "--warmup", help="Iterations left out of each run's statistics."),
    out: Path = typer.Option(Path("whatif-out"), "-o", "--out", help="Folder for the CSV, Markdown table, JSON and PNGs."),
    profile: Optional[Path] = typer.Option(
        None, "--profile", help="Calibration profile (nbox calibrate) over emulation.profile; selects model calibrated "
        "(a model= knob still picks other models for its points)."),
) -> None:
    """Run the training command over a grid of what-if knobs; write a CSV, a Markdown table and plots."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from ..fidelity.whatif import SweepStopped, parse_sweep, prepare_points, run_sweep, write_outputs

    if not sweep:
        raise InputError("--sweep: give at least one knob, e.g. --sweep inject.all_reduce=0ms,2ms,5ms")
    if repeats < 1:
        raise InputError(f"--repeats: must be 1 or more, got {repeats}")
    if not command:
        raise InputError("nbox whatif: no command to run (usage: nbox whatif TOPOLOGY --sweep K=V,.. -- python train.py)")
    from ..model.calibrated import with_profile

    base = with_profile(load(topology), profile)
    knobs = [parse_sweep(s) for s in sweep]
    points = prepare_points(base, knobs, profile)  # every point checked before the bar and the first run
    with Progress(TextColumn("[bold]what-if"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TextColumn("{task.description}"), console=console, transient=False) as bar:
        task = bar.add_task("", total=len(points) * repeats)

        def progress(done, total, point, _):
            bar.update(task, completed=done, description=", ".join(f"{k}={v}" for k, v in point.items()))

        stopped = None
        try:
            results = run_sweep(points, command, repeats, warmup, progress)
        except SweepStopped as exc:
            results, stopped = exc.results, exc
    if stopped is not None and not results:
        raise stopped
    context = (f"{base.name}: {base.world_size} ranks, model {base.emulation.model}, "
               f"{repeats} run{'s' if repeats > 1 else ''} per point; command: {' '.join(command)}")
    if len(context) > 150:
        context = context[:147] + "..."
    written = write_outputs(results, knobs, out, context)
    for path in written:
        console.print(f"wrote {path}")
    if not any(p.suffix == ".png" for p in written):
        console.print(f"no plots: matplotlib is not installed here (a dependency of neuronabox); where it is, "
                      f"`nbox report {out / 'whatif.json'}` draws them", style="yellow", highlight=False)
    console.print((out / "whatif.md").read_text())
    if stopped is not None:
        # The tables hold the points that ran (each over the repeats it finished); exit as stopped.
        console.print(f"partial: {len(results)} of {len(points)} points, {stopped.done} of {stopped.total} runs",
                      style="yellow", highlight=False)
        raise stopped


@app.command(no_args_is_help=True)  # no ignore_unknown_options: see run_cmd.py
def validate(
    topology: Path = typer.Argument(..., help="Topology YAML file (its nodes become a netns cluster)."),
    command: List[str] = typer.Argument(None, help="The training command, after --."),
    iterations: Optional[int] = typer.Option(None, "--iterations", help="Iterations compared after warm-up (default: all the runs have)."),
    warmup: int = typer.Option(1, "--warmup", help="Iterations of each run left out."),
    repeats: int = typer.Option(3, "--repeats", help="Runs of each system, interleaved."),
    tolerance: str = typer.Option("1%", "--tolerance", help="Largest |error| of the median that passes (1% or 0.01)."),
    modes: str = typer.Option("model,wire", "--modes", help="Systems to compare with the real one: model, wire "
                              "(emulated), real-again (the real system rerun: this machine's own error, an A/A floor; never gates)."),
    model: Optional[str] = typer.Option(None, "-m", "--model", help="Delay model of the emulated runs (default: the topology's)."),
    profile: Optional[Path] = typer.Option(
        None, "--profile", help="Calibration profile (nbox calibrate) over emulation.profile; selects model calibrated. "
        "With --calibrate: where to write the new one."),
    calibrate: bool = typer.Option(
        False, "--calibrate", help="First calibrate on the validation's own cluster, right before the runs (nbox "
        "calibrate's sweep of --calibrate-ops), and emulate with that profile (written to --profile, else to --logs, else "
        "dropped at the end)."),
    calibrate_ops: str = typer.Option(
        "all", "--calibrate-ops", help="With --calibrate: comma list of collectives to measure, or all (what gloo runs)."),
    calibrate_sizes: str = typer.Option(
        DEFAULT_SIZES, "--calibrate-sizes", help="With --calibrate: MIN:MAX message sizes (nbox calibrate --sizes); the "
        "largest the job sends is enough (DDP's buckets: 25 MiB by default)."),
    calibrate_precision: str = typer.Option(
        "2%", "--calibrate-precision", help="With --calibrate: nbox calibrate --precision (off: the sweep's passes only)."),
    calibrate_budget: str = typer.Option(
        "150ms", "--calibrate-budget", help="With --calibrate: nbox calibrate --budget (measuring time per size)."),
    calibrate_bucket_precision: str = typer.Option(
        "0.5%", "--calibrate-bucket-precision", help="With --calibrate: nbox calibrate --bucket-precision (finer: more "
        "samples from 256 KiB up, where DDP's buckets are, and a longer calibration)."),
    twin: bool = typer.Option(
        True, "--twin/--no-twin",
        help="Load twin (default on): during each emulated run, every other rank of the real system runs as its own "
        "nbox run, pinned to that rank's core, so the measured rank computes on a machine as busy as in the real "
        "system, whose ranks share this machine. --no-twin when the real ranks run on separate machines."),
    json_out: Optional[Path] = typer.Option(None, "--json", help="Write the error table and the raw iteration times here."),
    logs: Optional[Path] = typer.Option(None, "--logs", help="Keep every run's output in this folder."),
    rank: Optional[int] = typer.Option(None, "--rank", help="The emulated runs' real rank (default: the topology's)."),
    role_profile: Optional[Path] = typer.Option(
        None, "--role-profile", help="The emulated runs replay the other roles from this folder (nbox profile); "
        "with --roles, the profile is written there."
    ),
    roles: Optional[str] = typer.Option(
        None, "--roles", help="First record the role profile here, each role under the load twin (nbox profile's spec)."
    ),
    mesh: Optional[str] = typer.Option(None, "--mesh", help="With --roles: the device mesh, outermost first."),
    role_repeats: int = typer.Option(3, "--role-repeats", help="With --roles: runs per role (median compute)."),
    against: List[Path] = typer.Option(
        [], "--against", help="An nbox record folder of the real testbed (repeat: one per run): the real system is read "
        "from it instead of run here; only the emulated modes run."
    ),
) -> None:
    """Run the real system and the emulated one on the same shaped network; print the error table (exit 1 past --tolerance).
    \f

    (Not in --help, whose renderer keeps this paragraph's line breaks; --twin says the same.)
    The real system's ranks share this machine, so by default each emulated run has a load twin:
    the real system's other ranks run beside it (each its own nbox run, pinned to its core), and
    the measured rank computes on a machine as busy as the real system's. The twin does not
    reproduce the CPU the real system spends moving bytes. With the real ranks on separate
    machines there is nothing to reproduce: --no-twin.
    """
    import json

    from rich.table import Table

    from ..fidelity.calibrate import parse_ops, parse_precision, parse_size_range
    from ..fidelity.validate import parse_modes, parse_tolerance, run_validation
    from ..fidelity.verdict import UNDECIDED, UNDECIDED_WHY, error_table
    from ..units import UnitError, parse_duration

    tol = parse_tolerance(tolerance)
    mode_list = parse_modes(modes)
    if calibrate_ops != "all" and not calibrate:
        raise InputError("--calibrate-ops: only read with --calibrate")
    if calibrate_sizes != DEFAULT_SIZES and not calibrate:
        raise InputError("--calibrate-sizes: only read with --calibrate")
    if calibrate_precision != "2%" and not calibrate:
        raise InputError("--calibrate-precision: only read with --calibrate")
    if calibrate_budget != "150ms" and not calibrate:
        raise InputError("--calibrate-budget: only read with --calibrate")
    if calibrate_bucket_precision != "0.5%" and not calibrate:
        raise InputError("--calibrate-bucket-precision: only read with --calibrate")
    if (mesh is not None or role_repeats != 3) and roles is None:
        raise InputError("--mesh and --role-repeats: only read with --roles")
    cal_ops = parse_ops(calibrate_ops, "--calibrate-ops") if calibrate else None
    cal_sizes = parse_size_range(calibrate_sizes, "--calibrate-sizes") if calibrate else None
    cal_precision = parse_precision(calibrate_precision, "--calibrate-precision")
    cal_bucket = parse_precision(calibrate_bucket_precision, "--calibrate-bucket-precision")
    try:
        cal_budget_s = parse_duration(calibrate_budget)
    except UnitError as exc:
        raise InputError(f"--calibrate-budget: {exc}") from None
    if not command:
        raise InputError("nbox validate: no command to run (usage: nbox validate TOPOLOGY [OPTIONS] -- python train.py ARGS)")
    if not topology.is_file():
        raise InputError(f"{topology}: no such topology file")
    v = run_validation(topology, command, iterations=iterations, warmup=warmup, repeats=repeats, tolerance=tol,
                       modes=mode_list, model=model, profile=profile, progress=lambda m: console.print(f"[dim]{m}[/dim]"),
                       keep_logs=logs, twin=twin, calibrate_ops=cal_ops, calibrate_sizes=cal_sizes,
                       calibrate_precision=cal_precision, calibrate_budget_s=cal_budget_s,
                       calibrate_bucket_precision=cal_bucket, real_rank=rank,
                       role_profile=role_profile, roles=roles, mesh=mesh, role_repeats=role_repeats,
                       against=against or None)
    rows = error_table(v)
    twin_note = f", load twin rank(s) {','.join(map(str, v.twin_ranks))}" if v.twin_ranks else ", no load twin"
    if v.against:
        twin_note += f", real system read from {len(v.against)} nbox record run(s)"
    t = Table(title=f"nbox validate: {v.topology}, {v.iterations} iterations x {v.repeats} runs after {v.warmup} warm-up, "
                    f"model {v.model}{twin_note}, tolerance {v.tolerance:.2%}", title_justify="left")
    for i, col in enumerate(rows[0]):
        t.add_column(col, justify="left" if i in (0, len(rows[0]) - 1) else "right")
    for r in rows[1:]:
        t.add_row(*r)
    console.print(t)
    if any(UNDECIDED in m.verdict for m in v.modes):
        console.print(UNDECIDED_WHY)
    if v.floor_note():
        console.print(v.floor_note(), style="yellow", highlight=False)
    if json_out:
        json_out.write_text(json.dumps(v.as_dict(), indent=2) + "\n", encoding="utf-8")
        console.print(f"wrote {json_out}")
    if not v.passed:
        console.print(f"[red]nbox validate: an error exceeds the tolerance {v.tolerance:.2%}[/red]")
        raise typer.Exit(1)


@app.command(no_args_is_help=True)  # no ignore_unknown_options: see run_cmd.py
def record(
    command: List[str] = typer.Argument(None, help="The launcher and its arguments, after --."),
    out: Path = typer.Option(Path("nbox-record"), "-o", "--out", help="Folder for rank-<rank>.json (one per rank started)."),
) -> None:
    """Run a real job unchanged and record every rank's iterations, for nbox validate --against: nbox record -o DIR -- torchrun ..."""
    from ..fidelity.record import main_note, run_record
    from ..launcher.exits import describe_exit

    rc, files = run_record(command or [], out)
    if files:
        console.print(f"recorded rank(s) {', '.join(p.stem.removeprefix('rank-') for p in files)} in {out}")
    else:
        console.print(f"[yellow]{main_note()}[/yellow]")
    if rc < 0:
        # As a shell reports it (128 + the signal); passed on as is, -6 would read as status 250.
        sys.stderr.write(f"nbox record: {command[0]} {describe_exit(rc)}\n")
        rc = 128 - rc
    raise typer.Exit(rc)


@app.command(no_args_is_help=True)
def calibrate(
    topology: Path = typer.Argument(..., help="Topology YAML file (every rank runs for real in a netns cluster)."),
    sizes: str = typer.Option(DEFAULT_SIZES, "--sizes", help="MIN:MAX message sizes."),
    step: float = typer.Option(2.0, "--step", help="Multiply the size by this each step."),
    ops: str = typer.Option("all", "--ops", help="Comma list of collectives, or all (what gloo runs among real ranks)."),
    profile: Optional[Path] = typer.Option(None, "--profile", help="Write the profile here (default: the file emulation.profile names, else <topology>.profile.json beside it)."),
    max_op_time: str = typer.Option("500ms", "--max-op-time", help="Stop an op's sweep after the first size slower than this."),
    budget: str = typer.Option("150ms", "--budget", help="Measuring time per size (at least 3 samples); sizes whose "
                               "median is still uncertain get up to 10 budgets more, 400 in all."),
    precision: str = typer.Option("2%", "--precision", help="Sample a size until its median is known within this "
                                  "(95 % interval), within the budgets; off: the sweep's three passes only."),
    bucket_precision: str = typer.Option("0.5%", "--bucket-precision", help="The same from 256 KiB up, where DDP's "
                                         "buckets are (up to 40 budgets and 80 samples a size at 0.5 %, four times that "
                                         "at half of it); off: --precision there too."),
    write_topology: bool = typer.Option(
        False, "--write-topology", help="Set emulation.profile in the topology file to the new profile (other lines kept)."),
    part: str = typer.Option(
        "network", "--part", help="network (the ranks of every node over the shaped links), intra-node (the ranks of one "
                                  "node over this machine's own fabric, added to the profile) or all."),
    from_nccl_tests: List[str] = typer.Option(
        [], "--from-nccl-tests", help="nccl-tests output files (repeat the flag, or LOG,LOG): fit a hardware profile "
                                      "for the nccl model instead of measuring (writes --profile, default <topology>.hardware.yaml)."),
) -> None:
    """Measure the collectives on the real shaped links and fit a piecewise alpha-beta profile (model `calibrated`)."""
    import json

    if from_nccl_tests:
        _calibrate_from_logs(topology, [p for arg in from_nccl_tests for p in arg.split(",") if p], profile, write_topology)
        return

    from rich.table import Table

    from ..fidelity.calibrate import (
        default_sizes,
        load_for_calibration,
        parse_ops,
        parse_precision,
        parse_size_range,
        run_calibration,
        run_intra_node,
    )
    from ..fidelity.measure import pair_ratios
    from ..fidelity.profile import make_profile, profile_reference, save_profile, write_profile_field
    from ..model.profile import load_profile
    from ..units import UnitError, format_duration, format_size, parse_duration

    lo, hi = parse_size_range(sizes)
    op_list = parse_ops(ops)
    ci = parse_precision(precision)
    bucket_ci = parse_precision(bucket_precision, "--bucket-precision")
    try:
        max_op_s, budget_s = parse_duration(max_op_time), parse_duration(budget)
    except UnitError as exc:
        raise InputError(f"--max-op-time/--budget: {exc}") from None
    if part not in ("network", "intra-node", "all"):
        raise InputError(f"--part: network, intra-node or all, got {part!r}")
    topo, default_out, named = load_for_calibration(topology)
    out = profile or default_out
    say = lambda m: console.print(f"[dim]{m}[/dim]")  # noqa: E731
    sizes_list = default_sizes(lo, hi, step)
    intra = None
    if part in ("network", "all"):
        doc = run_calibration(topo, op_list, sizes_list, max_op_s=max_op_s, budget_s=budget_s, precision=ci,
                              bucket_precision=bucket_ci, progress=say)
    elif out.exists():
        doc = json.loads(out.read_text(encoding="utf-8"))  # the network part measured before: kept
        load_profile(out)  # a clear error for a file that is no profile
    else:
        doc = make_profile(topo, {}, {}, {}, {"seconds": 0.0})
    if part == "all" and topo.nodes[0].ranks < 2:
        say("intra-node: one rank per node, nothing to measure")
    elif part in ("intra-node", "all"):
        intra = doc["intra_node"] = run_intra_node(topo, op_list, sizes_list, max_op_s=max_op_s, budget_s=budget_s, precision=ci,
                                                   bucket_precision=bucket_ci, progress=say)
    save_profile(doc, out)
    if part != "intra-node":
        console.print(_fit_table(f"nbox calibrate: {topo.name} ({topology}), {doc['ranks']} ranks, "
                                 f"{doc['library']['name']} (torch {doc['library']['torch']}), {doc['meta']['seconds']:.0f} s",
                                 doc["ops"], doc["measurements"]))
    if intra:
        console.print(_fit_table(f"intra-node: {intra['ranks']} ranks of one {intra['device']} node on this machine, "
                                 f"{intra['library']['name']}, {intra['meta']['seconds']:.0f} s",
                                 intra["ops"], intra["measurements"]))
    busy, cpu = doc.get("busy_progress"), doc.get("cpu_cost")
    if busy:
        console.print(f"busy progress: an all-reduce of {format_size(busy['size'])} moves at {busy['rate']:.2f} of its idle "
                      f"speed while the ranks compute (idle {busy['idle_s'] * 1e3:.2f} ms)"
                      + (f"; fitted over {len(busy.get('windows') or [])} compute windows: none over its first "
                         f"{busy['stall_s'] * 1e3:.2f} ms of compute, then {busy['rate_after_stall']:.2f}"
                         if busy.get("stall_s") is not None else ""))
    if cpu:
        from ..emu.host_effects.footprint import interference

        k = interference(doc)
        console.print(f"cpu cost per rank: {cpu['per_op_s'] * 1e6:.0f} us + {cpu['per_byte_s'] * 1e9:.2f} ns/B per all-reduce "
                      + (f"x {k:.2f} (the compute the slowest rank lost beside one) " if k else "")
                      + "(model mode spends it on the real rank's core)")
    pair = doc.get("concurrency")
    if pair:
        console.print(f"two at once: two all-reduces of {format_size(pair['size'])} take {pair['pair_s'] * 1e3:.2f} ms together, "
                      f"one {pair['single_s'] * 1e3:.2f} ms alone (gloo runs two ops of a group at once)")
        ratios = pair_ratios(pair)
        if len(ratios) > 1:
            console.print("two at once over one after the other, by size: "
                          + ", ".join(f"{format_size(size)} {r:.2f}" for size, r in ratios))
    stall = doc.get("spin_stall")
    if stall and stall.get("cells"):
        t = Table(title="ops issued after compute (model mode draws these per op)")
        for col in ("size", "compute before", "median extra", "a rank spun", "median spin"):
            t.add_column(col, justify="right")
        for c in stall["cells"]:
            t.add_row(format_size(c["size"]), format_duration(c["gap_s"]), format_duration(c["median_excess_s"]),
                      f"{c['spun']:.0%} of {len(c['samples'])}", format_duration(c["median_spin_stall_s"]))
        console.print(t)
    for name, why in {**doc["unsupported"], **((intra or {}).get("unsupported") or {})}.items():
        console.print(f"[yellow]{name}: not measured ({why})[/yellow]")
    console.print(f"wrote {out}")
    if named and out.resolve() == default_out.resolve():
        console.print(f"{topology} names this profile already (emulation.profile)")
    elif write_topology:
        ref = write_profile_field(topology, out)
        console.print(f"set emulation.profile: {ref} in {topology}")
    else:
        ref = profile_reference(topology, out)
        console.print(f"to use it, add under emulation: in {topology} (or pass --profile {out}):\n  profile: {ref}")
    if topo.emulation.model != "calibrated" and "model" in (topo.raw.get("emulation") or {}):
        console.print(f"[yellow]note: {topology} names model {topo.emulation.model}; the profile is read by model "
                      "calibrated (set model: calibrated, or pass --profile to nbox run)[/yellow]")


def _calibrate_from_logs(topology: Path, logs: List[str], out: Optional[Path], write_topology: bool) -> None:
    """``calibrate --from-nccl-tests``: fit a hardware profile to the logs, print the fit beside them."""
    from ..fidelity.hardware_fit import accuracy, compare_rows, fit_profile, large_size_errors, measured_points
    from ..fidelity.nccl_log import read_log
    from ..fidelity.profile import profile_reference, write_profile_field
    from ..model.hardware import as_yaml
    from ..report.nccl_tests import ROUGH, format_compare
    from ..topology import load_topology

    topo = load_topology(topology)
    measured = [measured_points(topo, read_log(p, default_ranks=topo.world_size)) for p in logs]
    prof = fit_profile(f"{topo.name}-hardware", measured, description=f"fitted by nbox calibrate --from-nccl-tests on {topology}",
                       progress=lambda m: console.print(f"[dim]{m}[/dim]"))
    rows = [compare_rows(m, prof.node if m.n_nodes == 1 else prof.network) for m in measured]
    # The profile says how well it fits its own logs, so that nbox bench can say what to expect of it.
    prof = prof.model_copy(update={"accuracy": accuracy([large_size_errors(r) for r in rows],
                                                         by="nbox calibrate --from-nccl-tests")})
    out = out or topology.with_name(f"{topology.stem}.hardware.yaml")
    out.write_text(as_yaml(prof), encoding="utf-8")
    for m, r in zip(measured, rows):
        head = [f"{m.log.path}: {m.log.op.value}, {m.log.ranks} ranks on {m.n_nodes} node(s)"
                + (f", NCCL {m.log.nccl_version}" if m.log.nccl_version else ""), "model nccl with the fitted profile"]
        sys.stdout.write(format_compare(r, head, m.log.timing_gaps(ROUGH)) + "\n\n")
    console.print(f"wrote {out}")
    if write_topology:
        ref = write_profile_field(topology, out, "hardware")
        console.print(f"set emulation.hardware: {ref} in {topology}")
    else:
        console.print(f"to use it, add under emulation: in {topology}:\n  hardware: {profile_reference(topology, out)}")


def _fit_table(title: str, ops: dict, measurements: dict):
    """A profile part's fitted segments per op, as a rich table."""
    from rich.table import Table

    from ..units import format_duration, format_size

    t = Table(title=title, title_justify="left")
    for col in ("op", "sizes", "segment", "alpha", "bus bandwidth", "rms error"):
        t.add_column(col, justify="left" if col in ("op", "segment") else "right")
    for name, fit in ops.items():
        meas = measurements[name]
        for i, s in enumerate(fit["segments"]):
            hi_s = "∞" if s["hi"] is None else format_size(s["hi"])
            bw = "-" if s["bandwidth_Bps"] is None else f"{s['bandwidth_Bps'] * 8 / 1e6:.1f} Mbit/s"
            t.add_row(name if i == 0 else "", f"{format_size(meas[0]['size'])}-{format_size(meas[-1]['size'])}" if i == 0 else "",
                      f"[{format_size(s['lo'])}, {hi_s})", format_duration(s["alpha_s"]), bw,
                      f"{fit['rms_rel_error']:.1%}" if i == 0 else "")
    return t
