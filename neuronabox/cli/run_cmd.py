"""``nbox run``: the user's unmodified script as the real rank, every other rank emulated."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import List, Optional

import typer

from ..errors import InputError
from . import BANDWIDTH_SCALE, INJECT, LATENCY_SCALE, WORLD_SIZE, app, console, load


# No ignore_unknown_options: everything after `--` is the command anyway, and a mistyped option
# before it (--reprot) must get click's "No such option ... Did you mean --report?", not be run.
@app.command(no_args_is_help=True)
def run(
    topology: Path = typer.Argument(..., help="Topology YAML file."),
    command: List[str] = typer.Argument(None, help="The training command, after --, e.g. -- python train.py --epochs 1"),
    rank: Optional[int] = typer.Option(None, "--rank", help="Which rank is real (default: the topology's first real rank)."),
    model: Optional[str] = typer.Option(None, "-m", "--model", help="Delay model (default: the topology's)."),
    profile: Optional[Path] = typer.Option(
        None, "--profile", help="Calibration profile (nbox calibrate) over emulation.profile; selects model calibrated."
    ),
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
    nproc_per_node: int = typer.Option(
        1, "--nproc-per-node", help="Real ranks on this machine (torchrun's flag; CPU workers get a core each)."
    ),
    nnodes: str = typer.Option("1", "--nnodes", help="Real nodes (machines) taking part, each running nbox run."),
    node_rank: Optional[int] = typer.Option(None, "--node-rank", help="This machine's node rank (static rendezvous)."),
    rdzv_endpoint: Optional[str] = typer.Option(None, "--rdzv-endpoint", help="HOST:PORT of the rendezvous (node 0)."),
    rdzv_backend: Optional[str] = typer.Option(None, "--rdzv-backend", help="c10d or static (torchrun's default)."),
    rdzv_id: Optional[str] = typer.Option(None, "--rdzv-id", help="The job id every node passes alike."),
    max_restarts: int = typer.Option(0, "--max-restarts", help="Restarts of the worker group after a failure."),
    role_profile: Optional[Path] = typer.Option(
        None, "--role-profile", help="Replay the other roles' programs from this folder (nbox profile)."
    ),
) -> None:
    """Run a training command as the real rank of TOPOLOGY; the rest of the cluster is emulated."""
    # The topology first: a bad file is refused before the model's and launcher's imports (numpy,
    # networkx), in a third of the time.
    topo = load(topology, inject, latency_scale, bandwidth_scale, straggler, world_size)
    from ..launcher.runner import describe_exit, run_command
    from ..model.calibrated import with_profile
    from ..model.nccl_env import from_environment
    from ..model.registry import create_model
    from ..report.run_summary import summarize, summary_tables
    from ..report.trace import write_trace

    topo = with_profile(topo, profile, model)
    changes = {k: v for k, v in (("algorithm", algorithm),) if v is not None}
    if changes:
        topo = topo.with_changes(emulation=changes)
    create_model(topo)  # a bad model, algorithm or NCCL release fails here, before the script starts
    from_environment(topo, os.environ)  # and a bad NCCL_ALGO or the like, which nccl-model ranks read as NCCL does
    real = rank if rank is not None else topo.emulation.real_ranks[0]
    if warmup is not None and warmup < 0:
        raise InputError(f"--warmup: must be 0 or more, got {warmup}")
    if mode not in ("model", "wire"):
        raise InputError(f"--mode: expected model or wire, got {mode!r}")
    for flag, path in (("--report", report), ("--trace", trace)):
        # Made before the run, so that a folder that cannot be made costs no training run and the
        # summary is not lost to a traceback after it.
        if path is not None:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise InputError(f"{flag} {path}: cannot make its folder ({exc.strerror})") from None
    if mode == "wire" and not cluster:
        raise InputError("--mode wire needs --cluster NAME (a cluster brought up with `nbox up`)")
    from ..metrics.progress import RunProgress

    if metrics_addr:
        _check_metrics_addr(metrics_addr, nproc_per_node, in_cluster=cluster is not None)
    extra_env = {"NBOX_METRICS_ADDR": metrics_addr} if metrics_addr else {}
    from ..launcher.elastic import LaunchOptions

    launch = LaunchOptions(nproc_per_node, nnodes, node_rank, rdzv_endpoint, rdzv_backend, rdzv_id, max_restarts)
    if launch.elastic() and rank is not None:
        raise InputError("--rank: picks the one real rank; with --nproc-per-node/--nnodes the real ranks are the "
                         "topology's emulation.real_ranks or the first K ranks of the first N nodes")
    if role_profile is not None:
        from ..launcher.profiling import replay_env

        if launch.elastic():
            raise InputError("--role-profile: replay runs with one real rank; the others follow their roles' programs")
        if mode != "model":
            raise InputError("--role-profile: replay runs in model mode (--mode model)")
        extra_env.update(replay_env(role_profile, topo, command or []))
    with RunProgress(console, enabled=False if quiet else None):
        if launch.elastic():
            from ..launcher.runner import run_real_ranks

            result = run_real_ranks(topo, command or [], launch, cluster=cluster, mode=mode, extra_env=extra_env)
        else:
            result = run_command(topo, command or [], real, cluster=cluster, mode=mode, extra_env=extra_env)
    if result.record is None:
        # Only a command that ran to its end: one that failed says why itself, and one killed by
        # a signal had no exit in which to write its record (it may well have made calls).
        if result.returncode == 0:
            print(f"nbox: warning: {' '.join(command or [])!r} made no torch.distributed calls "
                  "(no init_process_group): nothing was emulated, so there is no summary", file=sys.stderr)
    else:
        from ..report.run_summary import summarize_ranks

        meta = {"topology": topo.name, "file": str(topology), "command": list(command or [])}
        if len(result.records) > 1:  # several real ranks: each one's report, side by side
            rep = summarize_ranks(result.records, warmup, meta)
        else:
            rep = summarize(result.record, warmup, meta)
        if report:
            report.write_text(json.dumps(rep, indent=2) + "\n", encoding="utf-8")
        if trace:  # with several real ranks: the first one's
            write_trace(rep, trace)
        if not quiet:
            for table in summary_tables(rep):
                console.print(table)
            for path in (report, trace):
                if path:
                    console.print(f"wrote {path}")
            from ..report.run_summary import next_steps

            console.print(next_steps(rep, str(report) if report else None), highlight=False, soft_wrap=True)
    if result.stopped_by:
        # Ctrl-C or SIGTERM, passed on to the command: what ran is summarized above; exit as the
        # shell would for that signal (130, 143).
        import signal

        tail = "" if result.record is not None else "; it wrote no record, so there is no summary"
        how = "torch's agent stopped the workers" if launch.elastic() else f"the command {describe_exit(result.returncode)}"
        print(f"nbox: stopped by {result.stopped_by}: {how}{tail}", file=sys.stderr)
        raise typer.Exit(128 + int(getattr(signal, result.stopped_by)))
    if result.returncode != 0:
        why = list(result.failures.values()) + ([result.error] if result.error else [])
        if not launch.elastic() or not why:
            why = [f"the command {describe_exit(result.returncode)}"]
        if result.record is None and result.returncode < 0:
            why.append("it wrote no record, so there is no summary")
        print(f"nbox: error: {'; '.join(why)}", file=sys.stderr)
        raise typer.Exit(1)


def _check_metrics_addr(text: str, ranks: int, in_cluster: bool) -> None:
    """Refuse a --metrics-addr the exporter could not serve, before the run (it would only warn, in the child).

    The host must resolve; outside a cluster (whose nodes have their own addresses) each real
    rank's port (the given one, plus its local rank) must be free here.
    """
    import socket

    from ..metrics.exporter import parse_addr

    try:
        host, port = parse_addr(text)
    except ValueError as exc:
        raise InputError(f"--metrics-addr: {exc}") from None
    try:
        infos = socket.getaddrinfo(host, port or None, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise InputError(f"--metrics-addr {text!r}: host {host!r} does not resolve ({exc.strerror})") from None
    if in_cluster or port == 0:
        return
    family, _, _, _, sockaddr = infos[0]
    for p in range(port, port + max(1, ranks)):
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the exporter's server does
            try:
                s.bind((sockaddr[0], p))
            except OSError as exc:
                raise InputError(f"--metrics-addr {text!r}: cannot serve on {sockaddr[0]}:{p} ({exc.strerror})") from None
