"""``nbox slurm``: an sbatch script that runs ``nbox run`` once on each real machine of the allocation.

One ``srun`` task per node; each task writes the topology (carried in the environment, so no
shared file system is needed) and runs the node command of ``context.node_command`` with
``--node-rank $SLURM_NODEID``, the rendezvous endpoint on the first host of
``scontrol show hostnames $SLURM_JOB_NODELIST`` and ``--rdzv-id $SLURM_JOB_ID``. The template
is ``deploy-templates/slurm/sbatch.sh.j2``; its context is listed in deploy-templates/README.md.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

from ..errors import InputError
from .context import DeployPlan, Var, Word, default_job_name, node_command, render_template, templates_dir

__all__ = ["slurm_context", "render_slurm", "shell_word", "SLURM_VARS", "TEMPLATE"]

TEMPLATE = "slurm/sbatch.sh.j2"
HEREDOC_END = "NBOX_TOPOLOGY_EOF"
# How each run-time value is spelled inside the per-node function (bash variables).
SLURM_VARS = {
    "topology": "topology_file",
    "node_rank": "SLURM_NODEID",
    "rdzv_endpoint": "NBOX_RDZV_ENDPOINT",
    "rdzv_id": "SLURM_JOB_ID",
}
# sbatch's --time formats: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S.
_TIME = re.compile(r"^(\d+(:\d{1,2}){0,2}|\d+-\d{1,2}(:\d{1,2}){0,2})$")
# Partition and account names end up unquoted on #SBATCH lines: no blanks, no shell syntax.
_SLURM_NAME = re.compile(r"^[A-Za-z0-9_.,:@+-]+$")


def shell_word(word: Word, variables: dict[str, str] = SLURM_VARS) -> str:
    """One bash word: literal pieces single-quoted where needed, placeholders as ``"${VAR}"``."""
    out = []
    for piece in word:
        out.append(f'"${{{variables[piece.name]}}}"' if isinstance(piece, Var) else shlex.quote(piece))
    return "".join(out) or "''"


def slurm_context(
    plan: DeployPlan,
    *,
    job_name: str | None = None,
    partition: str | None = None,
    account: str | None = None,
    time: str = "01:00:00",
    container_image: str | None = None,
    output: str = "%x-%j.out",
) -> dict[str, Any]:
    """The template context of the sbatch script (pure: writes nothing)."""
    name = job_name or default_job_name(plan.topology_name)
    if not _SLURM_NAME.match(name):
        raise InputError(f"--job-name: {name!r} may hold only letters, digits and _.,:@+-")
    if not _TIME.match(time):
        raise InputError(f"--time: expected HH:MM:SS (or any sbatch --time form, e.g. 90, 1-00:00:00), got {time!r}")
    for flag, value in (("--partition", partition), ("--account", account)):
        if value is not None and not _SLURM_NAME.match(value):
            raise InputError(f"{flag}: {value!r} may hold only letters, digits and _.,:@+-")
    if container_image is not None and (not container_image or any(c.isspace() for c in container_image)):
        raise InputError(f"--container-image: {container_image!r} is not an image reference")
    if any(line == HEREDOC_END for line in plan.topology_text.splitlines()):
        raise InputError(f"topology: a line reads {HEREDOC_END}, the script's here-document end marker")
    lines = [[shell_word(w) for w in line] for line in node_command(plan)]
    srun = [f"--nodes={plan.nnodes}", f"--ntasks={plan.nnodes}", "--ntasks-per-node=1", "--kill-on-bad-exit=1"]
    if container_image:
        # pyxis/enroot: the submit folder is mounted and is the working folder, as without a container.
        srun += [f"--container-image={shlex.quote(container_image)}",
                 '--container-mounts="${SLURM_SUBMIT_DIR}:${SLURM_SUBMIT_DIR}"',
                 '--container-workdir="${SLURM_SUBMIT_DIR}"']
    return {
        "launch": plan.summary(),
        "job_name": name,
        "sbatch": {
            "nodes": plan.nnodes,
            "ntasks_per_node": 1,
            "gpus_per_node": plan.gpus_per_node,
            "time": time,
            "partition": partition,
            "account": account,
            "output": output,
        },
        "srun_options": srun,
        "container_image": container_image,
        "topology_yaml": plan.topology_text.rstrip("\n"),
        "heredoc_end": HEREDOC_END,
        "rdzv_port": plan.rdzv_port,
        "metrics_port": plan.metrics_port,
        "node_command_lines": [" ".join(line) for line in lines],
        "vars": SLURM_VARS,
    }


def render_slurm(
    plan: DeployPlan, *, templates: str | Path | None = None, **options: Any
) -> tuple[str, dict[str, Any]]:
    """The sbatch script for ``plan`` and the context it was rendered from."""
    ctx = slurm_context(plan, **options)
    return render_template(templates_dir(templates), TEMPLATE, ctx), ctx
