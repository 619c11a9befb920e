"""Launching the real ranks on a real cluster: an sbatch script (Slurm) or Kubernetes manifests, from Jinja2 templates.

``context`` builds the one ``nbox run`` command every real machine runs (torch's elastic
launcher and c10d rendezvous underneath); ``slurm`` and ``k8s`` spell its run-time values
for their scheduler and render ``deploy-templates/``.
"""

from .context import DeployPlan, RunOptions, node_command, plan_deploy, templates_dir
from .k8s import render_k8s
from .slurm import render_slurm

__all__ = ["DeployPlan", "RunOptions", "node_command", "plan_deploy", "templates_dir", "render_k8s", "render_slurm"]
