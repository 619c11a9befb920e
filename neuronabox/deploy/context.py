"""What every real node of a multi-machine run executes, independent of the scheduler.

``plan_deploy`` checks the real-node shape (N nodes x K ranks) against the topology and
returns a ``DeployPlan``; ``node_command`` is the one ``nbox run`` command line each real node
runs, as words made of literal text and ``Var`` placeholders (the node rank, the rendezvous
endpoint, ...). The Slurm and Kubernetes renderers only decide how a placeholder is spelled:
``"${SLURM_NODEID}"`` in bash, ``$(NBOX_NODE_RANK)`` in a Kubernetes container's args.

The command (the flags are ``nbox run``'s, which hands them to torch's elastic launcher)::

    nbox run TOPOLOGY --nnodes N --node-rank <node_rank> --nproc-per-node K
        --rdzv-backend c10d --rdzv-endpoint <rdzv_endpoint> --rdzv-id <rdzv_id>
        --metrics-addr 0.0.0.0:METRICS_PORT [--model M] [--algorithm A] [--inject OP=+T ...]
        [--latency-scale X] [--bandwidth-scale X] [--straggler R=F ...] [--report PATH]
        -- CMD ...
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence, Union

from ..errors import InputError

__all__ = [
    "Var", "Word", "DeployPlan", "RunOptions", "plan_deploy", "node_command", "templates_dir", "jinja_environment",
    "render_template", "check_port", "dns_label", "default_job_name", "rank_ranges", "DEFAULT_RDZV_PORT",
    "DEFAULT_METRICS_PORT",
]

DEFAULT_RDZV_PORT = 29500  # torchrun's default master/rendezvous port
DEFAULT_METRICS_PORT = 9464  # the real rank's exporter, as in the compose project
TEMPLATES_ENV = "NBOX_DEPLOY_TEMPLATES"
NODE_RANK_PLACEHOLDER = "{node_rank}"


@dataclass(frozen=True)
class Var:
    """A value only known on the node at run time; each renderer spells it its own way."""

    name: str  # one of: topology, node_rank, rdzv_endpoint, rdzv_id


# One command-line word: literal pieces and placeholders, concatenated.
Word = tuple[Union[str, Var], ...]


@dataclass(frozen=True)
class RunOptions:
    """The what-if and model options passed through to ``nbox run`` on every node (already validated)."""

    model: str | None = None
    algorithm: str | None = None
    inject: tuple[str, ...] = ()
    latency_scale: float | None = None
    bandwidth_scale: float | None = None
    stragglers: tuple[str, ...] = ()
    report: str | None = None


@dataclass(frozen=True)
class DeployPlan:
    """The real part of a multi-machine run: how many machines, how many real ranks each, and the ports."""

    topology_name: str
    topology_text: str  # the file as written: the nodes apply the same command-line what-ifs
    world_size: int
    node_count: int
    ranks_per_node: tuple[int, ...]
    device: str
    # The world ranks that run for real and the topology nodes holding them. Which machine plays
    # which node is torch's c10d rendezvous' choice (it orders the machines itself), not --node-rank's.
    real_ranks: tuple[int, ...]
    real_nodes: tuple[str, ...]
    nnodes: int
    nproc_per_node: int
    rdzv_port: int = DEFAULT_RDZV_PORT
    metrics_port: int = DEFAULT_METRICS_PORT
    gpus_per_node: int = 0
    command: tuple[str, ...] = ()
    options: RunOptions = field(default_factory=RunOptions)

    @property
    def real_world(self) -> int:
        """How many ranks run for real, over all machines."""
        return self.nnodes * self.nproc_per_node

    @property
    def metrics_ports(self) -> list[int]:
        """The exporter ports on each machine: ``nbox run`` serves real rank i there at metrics_port + i."""
        return [self.metrics_port + i for i in range(self.nproc_per_node)]

    def summary(self) -> dict:
        """The plan as plain data for templates (``launch`` in the context)."""
        return {
            "topology": {"name": self.topology_name, "world_size": self.world_size, "node_count": self.node_count,
                         "device": self.device},
            "real_ranks": list(self.real_ranks),
            "real_nodes": list(self.real_nodes),
            "real_ranks_text": rank_ranges(self.real_ranks),
            "nnodes": self.nnodes,
            "nproc_per_node": self.nproc_per_node,
            "real_world": self.real_world,
            "emulated": self.world_size - self.real_world,
            "rdzv_backend": "c10d",
            "rdzv_port": self.rdzv_port,
            "metrics_port": self.metrics_port,
            "metrics_ports": self.metrics_ports,
            "gpus_per_node": self.gpus_per_node,
            "command": list(self.command),
        }


def rank_ranges(ranks: Sequence[int]) -> str:
    """``[0, 1, 2, 3, 8, 9]`` -> ``"0-3, 8-9"``."""
    out: list[str] = []
    start = prev = None
    for r in sorted(ranks):
        if prev is not None and r == prev + 1:
            prev = r
            continue
        if start is not None:
            out.append(str(start) if start == prev else f"{start}-{prev}")
        start = prev = r
    if start is not None:
        out.append(str(start) if start == prev else f"{start}-{prev}")
    return ", ".join(out)


def check_port(flag: str, port: int) -> int:
    """A TCP port in 1-65535, or an InputError naming the flag."""
    if not isinstance(port, int) or not 0 < port < 65536:
        raise InputError(f"{flag}: expected a port in 1-65535, got {port}")
    return port


def _choose_real_ranks(topology, nproc_per_node: int, nnodes: int) -> list[int]:
    """The world ranks ``nbox run`` will make real for N x K (its own rule, so both check the same way)."""
    from ..launcher.elastic import choose_real_ranks

    # --nproc-per-node/--nnodes name the flags of nbox run; here they are --nproc-per-node/--nodes.
    try:
        return choose_real_ranks(topology, nproc_per_node, nnodes)
    except InputError as exc:
        raise InputError(str(exc).replace("--nnodes:", "--nodes:", 1)) from None


def plan_deploy(
    topology,
    *,
    command: Sequence[str],
    nnodes: int | None = None,
    nproc_per_node: int | None = None,
    rdzv_port: int = DEFAULT_RDZV_PORT,
    metrics_port: int = DEFAULT_METRICS_PORT,
    gpus_per_node: int | None = None,
    options: RunOptions = RunOptions(),
) -> DeployPlan:
    """Check N real machines x K ranks each against ``topology`` (defaults: what its ``real_ranks`` say)."""
    if not command:
        raise InputError("missing the training command: put it after --, e.g. -- python train.py")
    groups: dict[int, int] = {}
    for r in topology.emulation.real_ranks:
        idx = topology.node_of(r).index
        groups[idx] = groups.get(idx, 0) + 1
    n = len(groups) if nnodes is None else nnodes
    k = max(groups.values()) if nproc_per_node is None else nproc_per_node
    nodes = topology.nodes
    if n < 1:
        raise InputError(f"--nodes: must be 1 or more, got {n}")
    if n > len(nodes):
        raise InputError(f"--nodes: {n} real machines, but topology {topology.name} has only {len(nodes)} nodes")
    if k < 1:
        raise InputError(f"--nproc-per-node: must be 1 or more, got {k}")
    real = _choose_real_ranks(topology, k, n)
    check_port("--port", rdzv_port)
    check_port("--metrics-port", metrics_port)
    # nbox run serves real rank i of a machine at metrics_port + i.
    if metrics_port + k - 1 > 65535:
        raise InputError(f"--metrics-port: {metrics_port}: the exporters of {k} ranks per machine need ports "
                         f"{metrics_port}-{metrics_port + k - 1}, beyond 65535")
    if metrics_port <= rdzv_port < metrics_port + k:
        raise InputError(f"--metrics-port: {metrics_port}: the exporters' ports {metrics_port}-{metrics_port + k - 1} "
                         f"hold the rendezvous port {rdzv_port} (--port)")
    device = topology.node_of(real[0]).device
    if device.lower() != "cpu":
        # nbox run's rule, checked here so that a script does not fail only once it runs on the cluster:
        # torchrun gives worker i CUDA device LOCAL_RANK = i, so GPU real ranks are each node's first K.
        for i, r in enumerate(real):
            if topology.local_rank(r) != i % k:
                raise InputError(f"emulation.real_ranks: on GPU nodes the real ranks must be the first {k} local "
                                 f"ranks of their nodes; rank {r} is local rank {topology.local_rank(r)}")
    gpus = (0 if device == "cpu" else k) if gpus_per_node is None else gpus_per_node
    if gpus < 0:
        raise InputError(f"--gpus-per-node: must be 0 or more, got {gpus}")
    if options.report is not None and not options.report.strip():
        raise InputError("--report: empty path")
    source = Path(topology.source)
    text = source.read_text(encoding="utf-8") if source.is_file() else _dump(topology)
    return DeployPlan(
        topology_name=topology.name, topology_text=text, world_size=topology.world_size, node_count=len(nodes),
        ranks_per_node=tuple(nd.ranks for nd in nodes), device=device,
        real_ranks=tuple(real), real_nodes=tuple(dict.fromkeys(topology.node_of(r).name for r in real)),
        nnodes=n, nproc_per_node=k, rdzv_port=rdzv_port,
        metrics_port=metrics_port, gpus_per_node=gpus, command=tuple(command), options=options,
    )


def _dump(topology) -> str:
    from ..topology.resolve import dump_yaml

    return dump_yaml(topology)


def _number(value: float) -> str:
    return repr(int(value)) if float(value).is_integer() else repr(float(value))


def _report_word(path: str, nnodes: int) -> Word:
    """The report path with ``{node_rank}`` replaced by the node rank (added before the suffix when N > 1)."""
    if NODE_RANK_PLACEHOLDER not in path:
        if nnodes == 1:
            return (path,)
        p = Path(path)
        stem = p.name[: -len(p.suffix)] if p.suffix else p.name
        path = str(p.with_name(f"{stem}.node{NODE_RANK_PLACEHOLDER}{p.suffix}"))
    parts: list[str | Var] = []
    for i, piece in enumerate(path.split(NODE_RANK_PLACEHOLDER)):
        if i:
            parts.append(Var("node_rank"))
        if piece:
            parts.append(piece)
    return tuple(parts)


def node_command(plan: DeployPlan) -> list[list[Word]]:
    """The ``nbox run`` command of every real node, as lines of words (a line: a flag and its value)."""
    o = plan.options
    lines: list[list[Word]] = [
        [("nbox",), ("run",), (Var("topology"),)],
        [("--nnodes",), (str(plan.nnodes),), ("--node-rank",), (Var("node_rank"),)],
        [("--nproc-per-node",), (str(plan.nproc_per_node),)],
        [("--rdzv-backend",), ("c10d",)],
        [("--rdzv-endpoint",), (Var("rdzv_endpoint"),)],
        [("--rdzv-id",), (Var("rdzv_id"),)],
        [("--metrics-addr",), (f"0.0.0.0:{plan.metrics_port}",)],
    ]
    if o.model:
        lines.append([("--model",), (o.model,)])
    if o.algorithm:
        lines.append([("--algorithm",), (o.algorithm,)])
    lines += [[("--inject",), (spec,)] for spec in o.inject]
    if o.latency_scale is not None:
        lines.append([("--latency-scale",), (_number(o.latency_scale),)])
    if o.bandwidth_scale is not None:
        lines.append([("--bandwidth-scale",), (_number(o.bandwidth_scale),)])
    lines += [[("--straggler",), (spec,)] for spec in o.stragglers]
    if o.report:
        lines.append([("--report",), _report_word(o.report, plan.nnodes)])
    lines.append([("--",), *[(a,) for a in plan.command]])
    return lines


def templates_dir(override: str | os.PathLike | None = None) -> Path:
    """The templates: ``override``, else ``$NBOX_DEPLOY_TEMPLATES``, else the checkout's ``deploy-templates/``."""
    if override is not None:
        path, what = Path(override), "--templates"
    elif os.environ.get(TEMPLATES_ENV):
        path, what = Path(os.environ[TEMPLATES_ENV]), TEMPLATES_ENV
    else:
        # Like compose-templates/: the templates ship with the source checkout (editable install).
        path, what = Path(__file__).resolve().parents[2] / "deploy-templates", None
        if not path.is_dir():
            raise InputError(f"deploy-templates/ not found (it ships with the source checkout, expected at {path}); "
                             f"pass --templates DIR or set {TEMPLATES_ENV}")
    if not path.is_dir():
        raise InputError(f"{what}: {path} is not a folder")
    return path


def jinja_environment(folder: Path):
    """Jinja2 over ``folder``: StrictUndefined (a misspelt key fails the render), no autoescape."""
    import json

    import jinja2

    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(folder)),
        undefined=jinja2.StrictUndefined,
        autoescape=False,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
    )
    # JSON scalars and lists are valid YAML; Jinja's own tojson would HTML-escape '&' and '<'.
    env.filters["tojson"] = lambda value, indent=None: json.dumps(value, indent=indent, ensure_ascii=False)
    return env


def render_template(folder: Path, name: str, context: dict) -> str:
    """Render one template of ``folder``; a template error becomes a one-line InputError naming the file."""
    import jinja2

    try:
        return jinja_environment(folder).get_template(name).render(context)
    except jinja2.TemplateNotFound:
        raise InputError(f"{folder}: no template {name}") from None
    except jinja2.UndefinedError as exc:
        raise InputError(f"{folder / name}: {exc.message}") from None
    except jinja2.TemplateError as exc:
        line = getattr(exc, "lineno", None)
        raise InputError(f"{folder / name}{f':{line}' if line else ''}: {exc}") from None


_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


def dns_label(flag: str, value: str, max_len: int = 63) -> str:
    """``value`` if it is a DNS-1123 label of at most ``max_len`` characters, else an InputError naming the flag."""
    if not _DNS_LABEL.match(value or "") or len(value) > max_len:
        raise InputError(f"{flag}: {value!r} is not a DNS label (lower-case letters, digits and '-', "
                         f"at most {max_len} characters, starting and ending with a letter or digit)")
    return value


def default_job_name(topology_name: str, max_len: int = 40) -> str:
    """``nbox-<topology name>`` folded into a DNS label (short enough for pod host names)."""
    base = re.sub(r"[^a-z0-9-]+", "-", f"nbox-{topology_name}".lower()).strip("-")
    return base[:max_len].rstrip("-") or "nbox"
