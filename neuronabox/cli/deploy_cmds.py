"""``nbox slurm`` and ``nbox k8s``: render what launches ``nbox run`` on each real machine of a cluster."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import List, Optional

import typer

from ..errors import InputError
from . import BANDWIDTH_SCALE, INJECT, LATENCY_SCALE, app, console, load

NODES = typer.Option(None, "--nodes", "-N", help="Real machines (default: the nodes of the topology's real ranks).")
NPROC = typer.Option(None, "--nproc-per-node", help="Real ranks per machine (default: the topology's, per node).")
GPUS = typer.Option(None, "--gpus-per-node", help="GPUs per machine (default: K on a GPU topology, 0 on CPU).")
PORT = typer.Option(29500, "--port", help="Port of torch's c10d rendezvous on the first machine.")
METRICS_PORT = typer.Option(9464, "--metrics-port", help="Port of each machine's Prometheus exporter (--metrics-addr).")
MODEL = typer.Option(None, "-m", "--model", help="Delay model (default: the topology's).")
ALGORITHM = typer.Option(None, "-a", "--algorithm", help="Force an algorithm of the model.")
STRAGGLER = typer.Option([], "--straggler", help="RANK=FACTOR: that rank computes FACTOR times slower (repeatable).")
REPORT = typer.Option(None, "--report", help="Report path on each machine; {node_rank} is replaced (added if N > 1).")
TEMPLATES = typer.Option(None, "--templates", help="Template folder (default: deploy-templates/ of the checkout).")


def _plan(topology, command, nodes, nproc, gpus, port, metrics_port, model, algorithm, inject, latency_scale,
          bandwidth_scale, straggler, report):
    """Validate everything a node would reject (what-ifs, model, N x K) and return the launch plan."""
    from ..deploy.context import RunOptions, plan_deploy
    from ..model.registry import create_model

    topo = load(topology, inject, latency_scale, bandwidth_scale, straggler)
    changes = {k: v for k, v in (("model", model), ("algorithm", algorithm)) if v is not None}
    if changes:
        topo = topo.with_changes(emulation=changes)
    create_model(topo)  # a bad model or algorithm fails here, not on the cluster
    options = RunOptions(model=model, algorithm=algorithm, inject=tuple(inject), latency_scale=latency_scale,
                         bandwidth_scale=bandwidth_scale, stragglers=tuple(straggler), report=report)
    return topo, plan_deploy(topo, command=command or [], nnodes=nodes, nproc_per_node=nproc, rdzv_port=port,
                             metrics_port=metrics_port, gpus_per_node=gpus, options=options)


def _describe(plan) -> str:
    return (f"{plan.nnodes} machine{'s' if plan.nnodes != 1 else ''} x {plan.nproc_per_node} real rank"
            f"{'s' if plan.nproc_per_node != 1 else ''} of {plan.world_size} ({plan.topology_name})")


@app.command("slurm", no_args_is_help=True)
def slurm_cmd(
    topology: Path = typer.Argument(..., help="Topology YAML file."),
    command: List[str] = typer.Argument(None, help="The training command, after --, e.g. -- python train.py"),
    output: Optional[Path] = typer.Option(None, "-o", "--output", help="The sbatch script to write (default: stdout)."),
    nodes: Optional[int] = NODES,
    nproc_per_node: Optional[int] = NPROC,
    partition: Optional[str] = typer.Option(None, "--partition", "-p", help="Slurm partition."),
    time: str = typer.Option("01:00:00", "--time", "-t", help="Time limit (sbatch --time)."),
    account: Optional[str] = typer.Option(None, "--account", "-A", help="Slurm account."),
    job_name: Optional[str] = typer.Option(None, "--job-name", "-J", help="Job name (default: nbox-<topology>)."),
    gpus_per_node: Optional[int] = GPUS,
    container_image: Optional[str] = typer.Option(None, "--container-image", help="Run in this image (pyxis srun)."),
    port: int = PORT,
    metrics_port: int = METRICS_PORT,
    model: Optional[str] = MODEL,
    algorithm: Optional[str] = ALGORITHM,
    inject: List[str] = INJECT,
    latency_scale: Optional[float] = LATENCY_SCALE,
    bandwidth_scale: Optional[float] = BANDWIDTH_SCALE,
    straggler: List[str] = STRAGGLER,
    report: Optional[str] = REPORT,
    templates: Optional[Path] = TEMPLATES,
) -> None:
    """An sbatch script running nbox run on each real machine: nbox slurm topo.yaml -o job.sh -- python train.py"""
    from ..deploy.slurm import render_slurm

    if output is not None and output.is_dir():
        raise InputError(f"-o: {output} is a folder (give the script's file name)")
    _, plan = _plan(topology, command, nodes, nproc_per_node, gpus_per_node, port, metrics_port, model, algorithm,
                    inject, latency_scale, bandwidth_scale, straggler, report)
    script, _ = render_slurm(plan, templates=templates, job_name=job_name, partition=partition, account=account,
                             time=time, container_image=container_image)
    if output is None:
        sys.stdout.write(script)
        return
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(script, encoding="utf-8")
    output.chmod(0o755)
    console.print(f"wrote {output}: {_describe(plan)}; submit it with: sbatch {output}",
                  highlight=False, soft_wrap=True)


@app.command("k8s", no_args_is_help=True)
def k8s_cmd(
    topology: Path = typer.Argument(..., help="Topology YAML file."),
    command: List[str] = typer.Argument(None, help="The training command, after --, e.g. -- python train.py"),
    output: Optional[Path] = typer.Option(None, "-o", "--output", help="Folder for the manifests (default: stdout)."),
    nodes: Optional[int] = NODES,
    nproc_per_node: Optional[int] = NPROC,
    image: str = typer.Option("neuronabox/node:latest", "--image", help="Image holding nbox and the training code."),
    namespace: Optional[str] = typer.Option(None, "--namespace", "-n", help="Namespace (default: kubectl's)."),
    name: Optional[str] = typer.Option(None, "--name", help="Job and service name (default: nbox-<topology>)."),
    kind: str = typer.Option("job", "--kind", help="job (indexed Job + headless Service), jobset or pytorchjob."),
    gpus_per_node: Optional[int] = GPUS,
    port: int = PORT,
    metrics_port: int = METRICS_PORT,
    model: Optional[str] = MODEL,
    algorithm: Optional[str] = ALGORITHM,
    inject: List[str] = INJECT,
    latency_scale: Optional[float] = LATENCY_SCALE,
    bandwidth_scale: Optional[float] = BANDWIDTH_SCALE,
    straggler: List[str] = STRAGGLER,
    report: Optional[str] = REPORT,
    templates: Optional[Path] = TEMPLATES,
) -> None:
    """Kubernetes manifests running nbox run in a pod per real machine: nbox k8s topo.yaml -o k8s/ -- python train.py"""
    from ..deploy.k8s import render_k8s

    if output is not None and output.exists() and not output.is_dir():
        raise InputError(f"-o: {output} exists and is not a folder")
    _, plan = _plan(topology, command, nodes, nproc_per_node, gpus_per_node, port, metrics_port, model, algorithm,
                    inject, latency_scale, bandwidth_scale, straggler, report)
    files, ctx = render_k8s(plan, templates=templates, kind=kind, name=name, namespace=namespace, image=image)
    if output is None:
        sys.stdout.write("---\n".join(files.values()))
        return
    output.mkdir(parents=True, exist_ok=True)
    for fname, text in files.items():
        (output / fname).write_text(text, encoding="utf-8")
        console.print(f"wrote {output / fname}", highlight=False, soft_wrap=True)
    console.print(f"{ctx['kind']} {ctx['name']}: {_describe(plan)}, rendezvous {ctx['rdzv_endpoint']}; "
                  f"apply with: kubectl apply -f {output}", highlight=False, soft_wrap=True)
