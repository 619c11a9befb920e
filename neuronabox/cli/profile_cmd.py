"""``nbox profile``: record each role's program (pipeline stages, experts) for ``nbox run --role-profile``."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from ..errors import InputError
from . import app, console, load


@app.command(
    no_args_is_help=True,
)
def profile(
    topology: Path = typer.Argument(..., help="Topology YAML file."),
    command: List[str] = typer.Argument(None, help="The training command, after --, e.g. -- python train.py"),
    roles: str = typer.Option(
        ..., "--roles", help="Rank sets, one per role (0,1 or 0-3,4-7), or mesh dimensions (pp)."
    ),
    mesh: Optional[str] = typer.Option(None, "--mesh", help="The device mesh, outermost first: pp=2,dp=4."),
    out: Path = typer.Option(Path("nbox-roles"), "-o", "--out", help="The profile folder to write."),
    repeats: int = typer.Option(
        1, "--repeats", help="Runs per role; each call's compute is the median of the runs (a busy machine's noise)."
    ),
    model: Optional[str] = typer.Option(
        None, "-m", "--model", help="Delay model of the profiling runs (default: the topology's)."
    ),
) -> None:
    """Run the command once per role, as that role's first rank, and record each role's program."""
    from ..launcher.profiling import record_profile
    from ..emu.roles import deferred, parse_roles
    from ..model.registry import create_model

    if not command:
        raise InputError("nbox profile: no command to run "
                         "(usage: nbox profile TOPOLOGY --roles 0,1 -- python train.py)")
    topo = load(topology)
    # auto, or mesh dimensions without --mesh: resolved from what rank 0's run records.
    spec = roles if deferred(roles) and not mesh else parse_roles(roles, topo.world_size, mesh)
    create_model(topo, model)  # a bad model fails here, before any run
    what = f"{len(spec.names)} roles" if not isinstance(spec, str) else f"roles {spec!r}"
    console.print(f"profiling {what} of {topo.world_size} ranks into {out}")

    def say(name: str, rank: int) -> None:
        if rank < 0:  # the roles, once rank 0's run told them
            console.print(f"  roles {name}")
            return
        console.print(f"  role {name}: rank {rank}" + (f", {repeats} runs" if repeats > 1 else "") + " ...")

    meta, runs = record_profile(topo, command, spec, out, model, on_role=say, repeats=repeats, mesh=mesh)
    for run in runs[repeats - 1::repeats]:
        prog = meta.programs.get(run.role) or meta.programs[meta.roles.role_of(run.rank)]
        ops = sum(1 for e in prog.events if e[0] == "op")
        med = f", iteration {run.iteration_median * 1e3:.2f} ms" if run.iteration_median else ""
        console.print(f"  role {prog.name}: {prog.iterations} iterations, {ops} ops{med}")
    again = f"nbox run {topology} --role-profile {out} -- {' '.join(command)}"
    console.print(f"wrote {out}; replay it with: {again}", soft_wrap=True)
