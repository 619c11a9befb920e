"""``nbox compose``: render the docker runtime's compose project without running it."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from ..errors import InputError
from . import app, console, load


@app.command(
    "compose",
    no_args_is_help=True,
)
def compose_cmd(
    topology: Path = typer.Argument(..., help="Topology YAML file."),
    command: List[str] = typer.Argument(None, help="The training command of the real node, after --."),
    output: Optional[Path] = typer.Option(None, "-o", "--output", help="Folder to write the compose project into."),
    name: Optional[str] = typer.Option(None, "--name", "-n", help="Cluster name (default: the topology's)."),
    gpus: Optional[int] = typer.Option(None, "--gpus", help="GPUs reserved for the real node (default: 1 on a GPU topology, else 0)."),
    rank: Optional[int] = typer.Option(None, "--rank", help="Which rank is real (default: the topology's first real rank)."),
    image_tag: str = typer.Option("latest", "--image-tag", help="Tag of the neuronabox/{node,stub,prometheus} images."),
    subnet: str = typer.Option("10.77.0.0/16", "--subnet", help="Address range of the cluster network."),
    templates: Optional[Path] = typer.Option(None, "--templates", help="Template folder (default: compose-templates/)."),
) -> None:
    """Render the docker compose project of TOPOLOGY into -o DIR: nbox compose topo.yaml -o DIR -- python train.py"""
    from ..cluster.compose import render_compose
    from ..cluster.state import default_name

    if output is None:
        raise InputError("nbox compose: -o DIR is required (the folder to write the compose project into)")
    if output.exists() and not output.is_dir():
        raise InputError(f"-o: {output} exists and is not a folder")
    topo = load(topology)
    res = render_compose(topo, output, name=name or default_name(topo.name), image_tag=image_tag, command=command or [],
                         gpus=gpus, real_rank=rank, subnet=subnet, templates=templates)
    ctx = res.context
    for rel in res.files:
        console.print(f"wrote {output / rel}")
    console.print(
        f"compose project {ctx['project_name']}: real node {ctx['real_node']['service']} "
        f"({ctx['gpus']} GPU{'s' if ctx['gpus'] != 1 else ''}), {len(ctx['stubs'])} stubs, agent, prometheus "
        f"(grafana with --profile grafana); images: nbox images build; run it with: "
        f"cd {output} && docker-compose up -d (or docker compose up -d)"
    )
