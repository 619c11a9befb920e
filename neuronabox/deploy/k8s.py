"""``nbox k8s``: Kubernetes manifests that run ``nbox run`` once in each of N pods (one pod per real machine).

Three shapes (``kind``):

- ``job`` (default, core API only): an indexed Job (``completionMode: Indexed``, N completions
  run in parallel) whose pods get the node rank from their completion index, and a headless
  Service whose DNS name ``<name>-0.<name>`` is pod 0, the c10d rendezvous host.
- ``jobset``: the same indexed Job as the one replicated job of a JobSet
  (``jobset.x-k8s.io/v1alpha2``); JobSet makes the headless service itself and pod 0 is
  ``<name>-node-0-0.<name>``.
- ``pytorchjob``: a Kubeflow ``PyTorchJob`` (``kubeflow.org/v1``): one Master and N-1 Workers;
  the training operator sets ``RANK`` (the node rank), ``MASTER_ADDR`` and ``MASTER_PORT``
  (the container port named ``pytorchjob-port``) and makes the services.

Every shape: a ConfigMap carrying the topology file, mounted at ``/etc/nbox``; the metrics port
as a named container port with ``prometheus.io/*`` scrape annotations on the pods;
``nvidia.com/gpu`` limits when G > 0; no extra capabilities (model mode shapes nothing).
Templates: ``deploy-templates/k8s/*.yaml.j2`` (context in deploy-templates/README.md).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from ..errors import InputError
from .context import DeployPlan, Var, Word, default_job_name, dns_label, node_command, render_template, templates_dir

__all__ = ["KINDS", "k8s_context", "render_k8s", "k8s_arg", "TOPOLOGY_DIR", "DEFAULT_IMAGE"]

KINDS = ("job", "jobset", "pytorchjob")
DEFAULT_IMAGE = "neuronabox/node:latest"  # the docker runtime's real-node image (docker/Dockerfile.node)
TOPOLOGY_DIR = "/etc/nbox"
TOPOLOGY_FILE = "topology.yaml"
NODE_RANK_ENV = "NBOX_NODE_RANK"
# The Job controller writes each pod's completion index into this annotation (and JOB_COMPLETION_INDEX).
COMPLETION_INDEX_FIELD = "metadata.annotations['batch.kubernetes.io/job-completion-index']"
# Pod host names are <name>-<index> (Job), <name>-node-0-<index> (JobSet), <name>-worker-<index>
# (PyTorchJob); 40 characters leave room for those suffixes in a 63-character DNS label.
MAX_NAME = 40
FILES = {
    "job": ("configmap.yaml", "service.yaml", "job.yaml"),
    "jobset": ("configmap.yaml", "jobset.yaml"),
    "pytorchjob": ("configmap.yaml", "pytorchjob.yaml"),
}


def k8s_arg(word: Word, variables: dict[str, str]) -> str:
    """One container argument: literal pieces with ``$`` doubled (Kubernetes' escape), placeholders as given."""
    return "".join(variables[p.name] if isinstance(p, Var) else p.replace("$", "$$") for p in word)


def _variables(kind: str, name: str, port: int) -> tuple[dict[str, str], str]:
    """How each run-time value is spelled in the container's command, and the rendezvous endpoint for people."""
    topology = f"{TOPOLOGY_DIR}/{TOPOLOGY_FILE}"
    if kind == "pytorchjob":
        # The training operator adds these to the container's environment; $(VAR) expands them.
        endpoint = "$(MASTER_ADDR):$(MASTER_PORT)"
        return {"topology": topology, "node_rank": "$(RANK)", "rdzv_endpoint": endpoint, "rdzv_id": name}, \
            f"{name}-master-0:{port}"
    host = f"{name}-0.{name}" if kind == "job" else f"{name}-node-0-0.{name}"
    endpoint = f"{host}:{port}"
    spelled = {"topology": topology, "node_rank": f"$({NODE_RANK_ENV})", "rdzv_endpoint": endpoint, "rdzv_id": name}
    return spelled, endpoint


def k8s_context(
    plan: DeployPlan,
    *,
    kind: str = "job",
    name: str | None = None,
    namespace: str | None = None,
    image: str = DEFAULT_IMAGE,
) -> dict[str, Any]:
    """The template context of the manifests (pure: writes nothing)."""
    if kind not in KINDS:
        raise InputError(f"--kind: expected one of {', '.join(KINDS)}, got {kind!r}")
    name = dns_label("--name", name if name is not None else default_job_name(plan.topology_name, MAX_NAME), MAX_NAME)
    if namespace is not None:
        dns_label("--namespace", namespace)
    if not image or any(c.isspace() for c in image):
        raise InputError(f"--image: {image!r} is not an image reference")
    variables, endpoint = _variables(kind, name, plan.rdzv_port)
    command = [k8s_arg(w, variables) for line in node_command(plan) for w in line]
    labels = {
        "app.kubernetes.io/name": "neuronabox",
        "app.kubernetes.io/instance": name,
        "app.kubernetes.io/component": "real-node",
        "app.kubernetes.io/managed-by": "nbox",
    }
    selector = {"app.kubernetes.io/instance": name, "app.kubernetes.io/component": "real-node"}
    env = [] if kind == "pytorchjob" else [{"name": NODE_RANK_ENV, "field_path": COMPLETION_INDEX_FIELD}]
    rdzv_port_name = "pytorchjob-port" if kind == "pytorchjob" else "rdzv"
    text = plan.topology_text.rstrip("\n") + "\n"  # what a YAML literal block (|) gives back
    pod = {
        "labels": labels,
        "annotations": {
            "prometheus.io/scrape": "true",
            "prometheus.io/port": str(plan.metrics_port),
            "prometheus.io/path": "/metrics",
        },
        "restart_policy": "Never",
        # Job pods are <name>-<index>.<subdomain>; JobSet and the operator set their own.
        "subdomain": name if kind == "job" else None,
        "container": {
            # The training operator looks for the container named "pytorch".
            "name": "pytorch" if kind == "pytorchjob" else "nbox",
            "image": image,
            "command": command,
            "env": env,
            # One exporter per real rank (metrics_port + local rank); the scrape annotation names
            # local rank 0's, a `role: pod` scrape job finds every declared port.
            "ports": [{"name": rdzv_port_name, "port": plan.rdzv_port}]
            + [{"name": "metrics" if i == 0 else f"metrics-{i}", "port": port}
               for i, port in enumerate(plan.metrics_ports)],
            "gpus": plan.gpus_per_node,
        },
        "configmap": f"{name}-topology",
        "topology_dir": TOPOLOGY_DIR,
    }
    return {
        "launch": plan.summary(),
        "kind": kind,
        "name": name,
        "namespace": namespace,
        "labels": labels,
        "selector": selector,
        "configmap": {"name": f"{name}-topology", "file": TOPOLOGY_FILE, "mount_dir": TOPOLOGY_DIR},
        "topology_yaml": text,
        # A literal block keeps the file readable; text it cannot hold goes in as a JSON string.
        "topology_as_block": not text[0].isspace() and "\t" not in text and "\r" not in text,
        "service": {"name": name, "ports": pod["container"]["ports"]} if kind == "job" else None,
        "rdzv_endpoint": endpoint,
        "metrics_port": plan.metrics_port,
        "pod": pod,
        "files": list(FILES[kind]),
    }


def render_k8s(
    plan: DeployPlan, *, templates: str | Path | None = None, **options: Any
) -> tuple[dict[str, str], dict[str, Any]]:
    """The manifests for ``plan`` (file name -> YAML text, in apply order) and the context."""
    ctx = k8s_context(plan, **options)
    folder = templates_dir(templates)
    out: dict[str, str] = {}
    for fname in ctx["files"]:
        text = render_template(folder, f"k8s/{fname}.j2", ctx)
        try:
            docs = [d for d in yaml.safe_load_all(text) if d is not None]
        except yaml.YAMLError as exc:
            raise InputError(f"{folder / 'k8s' / (fname + '.j2')}: rendered YAML does not parse: "
                             f"{' '.join(str(exc).split())}") from None
        if fname == "configmap.yaml" and docs[0]["data"][TOPOLOGY_FILE] != ctx["topology_yaml"]:
            raise InputError(f"{folder / 'k8s' / 'configmap.yaml.j2'}: the topology does not survive the render")
        out[fname] = text
    return out, ctx
