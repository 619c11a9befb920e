"""The docker runtime's compose project: every ``compose-templates/**/*.j2`` rendered with Jinja2.

``render_compose(topology, out_dir, name=..., ...)`` renders each template into ``out_dir``
under the same relative path without ``.j2`` (Jinja2 with StrictUndefined and autoescape
off; whitespace as in ``JINJA_OPTIONS``), copies the other files of the templates folder (READMEs
excepted), and writes what the templates mount: ``topology.yaml`` (the effective topology),
``nbox/cluster.json`` (what the in-container shaping agent applies), ``dashboards/`` (the
repository's Grafana dashboards) and an empty ``grafana/provisioning/{dashboards,datasources}``
when no template fills them.

Template context (also in compose-templates/README.md; a template that names anything else
fails to render, so a typo cannot produce a silently broken project):

- ``cluster_name``      the cluster (and compose project) name
- ``project_name``      the compose project name (``nbox-<name>``, lower case, as compose wants)
- ``topology``          ``{name, world_size, node_count, file}``; ``file`` is ``topology.yaml``
- ``nodes``             every node, in order: ``{name, service, index, ranks, address, role, shape, command}``;
                        ``ranks`` the node's global ranks, ``address`` its IPv4 address on the
                        cluster network, ``role`` ``real`` or ``stub``, ``shape`` its egress
                        ``{rate, delay, jitter, loss}`` (bytes/s, s, s, fraction), ``command``
                        its container command (a list, ``$`` doubled as compose wants)
- ``real_node``         the node entry holding the real rank; ``stubs`` every other node entry
- ``real_rank``         the global rank that runs for real
- ``links``             the synthesized topology's network links:
                        ``{name, a, b, rate, delay, delay_back, jitter, loss}`` in base units
- ``agent``             ``{service, address, url}`` of the shaping agent
- ``agent_port``        the agent's HTTP API and ``/metrics`` (default 9465)
- ``metrics_port``      the real rank's Prometheus exporter (default 9464)
- ``prometheus_port``   9090; ``grafana_port`` 3000 (both published on 127.0.0.1 only)
- ``scrape_interval``   ``"5s"``
- ``scrape_targets``    ``[{job, targets: ["host:port", ...], labels: {cluster: <name>}}, ...]``:
                        the real rank's exporter (job ``nbox-run``) and the agent (``nbox-agent``)
- ``network``           ``{name, subnet, gateway}`` of the one bridge network
- ``prometheus_address``, ``grafana_address``  their fixed addresses on that network
- ``images``            ``{node, stub, prometheus}`` image references (``nbox images build``); ``build`` ``{context, node, stub}``
                        (Dockerfiles relative to the context) or None when the repository is absent
- ``gpus``              GPUs reserved for the real node (0: no reservation)
- ``real_command``      the real node's command (a list): the training command under ``nbox run``
- ``stub_state_dir``    ``NBOX_STATE_DIR`` of the stubs (their control sockets live there)
- ``dashboards_dir``    ``./dashboards``, mounted into Grafana at ``dashboards_path``
                        (``/var/lib/grafana/dashboards/neuronabox``, where the provisioning looks)
- ``prometheus_host``   ``prometheus``, the service Grafana's data source points at

Shaping in docker: all nodes share one bridge, so the only link of the topology that
exists physically is each node's own interface. Each node's egress is shaped (tbf, plus
netem where the host kernel has it) with its NIC's rate and the one-way delay, jitter and
loss of its routes to the other nodes. That is exact for one switch or a ring of two and
the mean over destinations otherwise; the netns runtime realises multi-tier fabrics link
by link.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import yaml

from ..errors import InputError
from ..topology.resolve import dump_yaml
from .state import valid_name

__all__ = ["render_compose", "compose_context", "templates_dir", "repo_root", "Rendered", "DEFAULTS"]

DEFAULTS = {
    "agent_port": 9465,
    "metrics_port": 9464,
    "prometheus_port": 9090,
    "grafana_port": 3000,
    "scrape_interval": "5s",
    "subnet": "10.77.0.0/16",
}
GRAFANA_DASHBOARDS_PATH = "/var/lib/grafana/dashboards/neuronabox"
STUB_STATE_DIR = "/run/nbox"
# One whitespace mode for every template: neuronabox.metrics.scrape renders prometheus.yml.j2 and
# the Grafana provisioning with Jinja's defaults, and those templates rely on the newline after a
# block tag, which trim_blocks would eat. compose.yaml.j2 renders the same YAML either way.
JINJA_OPTIONS = {"autoescape": False, "trim_blocks": False, "lstrip_blocks": False, "keep_trailing_newline": True}
RESERVED_SERVICES = ("agent", "prometheus", "grafana")
# Fixed host numbers inside the subnet; nodes start after them so they never collide.
GATEWAY_HOST, AGENT_HOST, PROMETHEUS_HOST, GRAFANA_HOST, FIRST_NODE_HOST = 1, 2, 3, 4, 16


@dataclass
class Rendered:
    """What ``render_compose`` wrote: the project folder, the files (relative) and the context used."""

    out_dir: Path
    files: list[str] = field(default_factory=list)
    context: dict[str, Any] = field(default_factory=dict)

    @property
    def compose_file(self) -> Path:
        """The compose file of the project."""
        return self.out_dir / "compose.yaml"


def repo_root() -> Path | None:
    """The source checkout this package runs from (editable install), or None."""
    root = Path(__file__).resolve().parents[2]
    return root if (root / "compose-templates").is_dir() and (root / "pyproject.toml").is_file() else None


def templates_dir() -> Path:
    """The repository's ``compose-templates`` folder."""
    root = repo_root()
    if root is None:
        raise InputError("compose-templates/ not found (it ships with the source checkout); pass --templates DIR")
    return root / "compose-templates"


def _service_name(node: str) -> str:
    # Compose service names double as DNS names on the cluster network.
    svc = re.sub(r"[^a-z0-9_.-]", "-", node.lower()).strip("-.") or "node"
    return svc


def _node_shapes(plan) -> dict[str, dict[str, float]]:
    """Per node: egress rate of its NIC link, mean one-way route delay/jitter and route loss to the others."""
    from collections import defaultdict

    links = {lk.id: lk for lk in plan.links}
    per: dict[str, list[tuple[float, float, float, float]]] = defaultdict(list)
    for (src, _dst), hops in plan.pair_links.items():
        if not hops:
            continue
        first = links[hops[0][0]]
        delay = sum(links[lid].delay_ab if d == 0 else links[lid].delay_ba for lid, d in hops)
        jitter = sum(links[lid].jitter for lid, _ in hops)
        keep = 1.0
        for lid, _ in hops:
            keep *= 1.0 - links[lid].loss
        per[src].append((first.rate, delay, jitter, 1.0 - keep))
    out = {}
    for node, rows in per.items():
        n = len(rows)
        rates = [r[0] for r in rows if r[0] > 0 and r[0] != float("inf")]
        out[node] = {
            "rate": min(rates) if rates else 0.0,
            "delay": sum(r[1] for r in rows) / n,
            "jitter": sum(r[2] for r in rows) / n,
            "loss": sum(r[3] for r in rows) / n,
        }
    return out


def compose_context(
    topology,
    *,
    name: str,
    image_tag: str = "latest",
    command: Sequence[str] = (),
    gpus: int | None = None,
    real_rank: int | None = None,
    subnet: str = DEFAULTS["subnet"],
    agent_port: int = DEFAULTS["agent_port"],
    metrics_port: int = DEFAULTS["metrics_port"],
    prometheus_port: int = DEFAULTS["prometheus_port"],
    grafana_port: int = DEFAULTS["grafana_port"],
    scrape_interval: str = DEFAULTS["scrape_interval"],
    stub_command: Sequence[str] | None = None,
) -> dict[str, Any]:
    """The template context for ``topology`` (pure: writes nothing)."""
    import ipaddress

    from .netplan import plan_network

    name = valid_name(name)
    rank = topology.emulation.real_ranks[0] if real_rank is None else real_rank
    if not 0 <= rank < topology.world_size:
        raise InputError(f"--rank: rank {rank} is not in 0-{topology.world_size - 1}")
    real = topology.node_of(rank)
    if gpus is None:
        gpus = 0 if real.device == "cpu" else 1
    if gpus < 0:
        raise InputError(f"--gpus: must be 0 or more, got {gpus}")
    for label, port in (("agent", agent_port), ("metrics", metrics_port), ("prometheus", prometheus_port), ("grafana", grafana_port)):
        if not 0 < port < 65536:
            raise InputError(f"--{label}-port: expected 1-65535, got {port}")
    try:
        net = ipaddress.IPv4Network(subnet, strict=False)
    except ValueError as exc:
        raise InputError(f"--subnet: {exc}") from None
    if net.num_addresses < FIRST_NODE_HOST + len(topology.nodes) + 1:
        raise InputError(f"--subnet: {net} is too small for {len(topology.nodes)} nodes")

    plan = plan_network(topology, name, str(net))
    shapes = _node_shapes(plan)
    services: dict[str, str] = {}
    nodes = []
    for n in topology.nodes:
        svc = _service_name(n.name)
        if svc in RESERVED_SERVICES or svc in services:
            clash = svc if svc in RESERVED_SERVICES else services[svc]
            raise InputError(f"{topology.source}: cluster.nodes: node {n.name!r} would be service {svc!r}, "
                             f"which {'is reserved' if svc in RESERVED_SERVICES else 'node ' + repr(clash) + ' already is'}")
        services[svc] = n.name
        nodes.append({
            "name": n.name,
            "service": svc,
            "index": n.index,
            "ranks": list(n.rank_range),
            "address": str(net.network_address + FIRST_NODE_HOST + n.index),
            "role": "real" if n.index == real.index else "stub",
            "shape": shapes.get(n.name, {"rate": 0.0, "delay": 0.0, "jitter": 0.0, "loss": 0.0}),
        })
    real_node = nodes[real.index]
    train = list(command) if command else ["sleep", "infinity"]
    real_command = _dollars(["nbox", "run", "/nbox/topology.yaml", "--rank", str(rank), "--", *train] if command else train)
    for n in nodes:
        if n["role"] == "real":
            n["command"] = real_command
        elif stub_command:
            n["command"] = _dollars(list(stub_command))
        else:
            # The wire-mode stub peer (cluster/stub.py) keeps its control socket in the state directory.
            n["command"] = _dollars(["sh", "-c", f"mkdir -p {STUB_STATE_DIR}/{name} && exec python3 -m neuronabox.cluster.stub "
                                     f"--name {name} --node {shlex.quote(n['name'])} --address {n['address']}"])
    agent_addr = str(net.network_address + AGENT_HOST)
    root = repo_root()
    return {
        "cluster_name": name,
        "project_name": f"nbox-{name.lower()}",
        "topology": {"name": topology.name, "world_size": topology.world_size, "node_count": len(nodes),
                     "file": "topology.yaml"},
        "nodes": nodes,
        "real_node": real_node,
        "stubs": [n for n in nodes if n["role"] == "stub"],
        "real_rank": rank,
        "links": [
            {"name": lk.name, "a": lk.a.vertex, "b": lk.b.vertex, "rate": lk.rate, "delay": lk.delay_ab,
             "delay_back": lk.delay_ba, "jitter": lk.jitter, "loss": lk.loss}
            for lk in plan.links
        ],
        "agent": {"service": "agent", "address": agent_addr, "url": f"http://agent:{agent_port}"},
        "agent_port": agent_port,
        "metrics_port": metrics_port,
        "prometheus_port": prometheus_port,
        "grafana_port": grafana_port,
        "scrape_interval": scrape_interval,
        "scrape_targets": [
            {"job": "nbox-run", "targets": [f"{real_node['service']}:{metrics_port}"], "labels": {"cluster": name}},
            {"job": "nbox-agent", "targets": [f"agent:{agent_port}"], "labels": {"cluster": name}},
        ],
        "network": {"name": "cluster", "subnet": str(net), "gateway": str(net.network_address + GATEWAY_HOST)},
        "prometheus_address": str(net.network_address + PROMETHEUS_HOST),
        "grafana_address": str(net.network_address + GRAFANA_HOST),
        "images": {"node": f"neuronabox/node:{image_tag}", "stub": f"neuronabox/stub:{image_tag}",
                   "prometheus": f"neuronabox/prometheus:{image_tag}"},
        "build": {"context": str(root), "node": "docker/Dockerfile.node", "stub": "docker/Dockerfile.stub"} if root else None,
        "gpus": gpus,
        "real_command": real_command,
        "stub_state_dir": STUB_STATE_DIR,
        "dashboards_dir": "./dashboards",
        "dashboards_path": GRAFANA_DASHBOARDS_PATH,
        "prometheus_host": "prometheus",
    }


def _dollars(cmd: list[str]) -> list[str]:
    # Compose interpolates $VAR from the host's environment; $$ is its literal dollar.
    return [str(a).replace("$", "$$") for a in cmd]


def _environment(templates: Path, **overrides: Any):
    import jinja2

    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(templates)),
        undefined=jinja2.StrictUndefined,
        **{**JINJA_OPTIONS, **overrides},
    )
    # Templates quote values with tojson, since JSON scalars and lists are valid YAML. Jinja's own
    # tojson escapes <>&' for HTML (a shell command's && becomes \u0026\u0026): same YAML value,
    # but a compose file that people read should show the command as written.
    env.filters["tojson"] = lambda value, indent=None: json.dumps(value, indent=indent, ensure_ascii=False)
    return env


def render_compose(
    topology,
    out_dir: str | Path,
    *,
    name: str,
    image_tag: str = "latest",
    command: Sequence[str] = (),
    gpus: int | None = None,
    templates: str | Path | None = None,
    **options: Any,
) -> Rendered:
    """Render every template of ``templates`` (default: compose-templates/) for ``topology`` into ``out_dir``."""
    import jinja2

    from ..topology import Topology, load_topology

    topo = topology if isinstance(topology, Topology) else load_topology(topology)
    tdir = Path(templates) if templates else templates_dir()
    if not tdir.is_dir():
        raise InputError(f"--templates: {tdir} is not a folder")
    ctx = compose_context(topo, name=name, image_tag=image_tag, command=command, gpus=gpus, **options)
    env = _environment(tdir)
    out = Path(out_dir)
    rendered: dict[str, str] = {}
    # Render everything first: a template that fails leaves no half-written project behind.
    for src in sorted(p for p in tdir.rglob("*.j2") if p.is_file()):
        rel = src.relative_to(tdir).as_posix()
        try:
            rendered[rel[: -len(".j2")]] = env.get_template(rel).render(ctx)
        except jinja2.UndefinedError as exc:
            raise InputError(f"{src}: {exc.message}") from None
        except jinja2.TemplateError as exc:
            line = getattr(exc, "lineno", None)
            raise InputError(f"{src}{f':{line}' if line else ''}: {exc}") from None
    if "compose.yaml" not in rendered:
        raise InputError(f"{tdir}: no compose.yaml.j2")
    out.mkdir(parents=True, exist_ok=True)
    files: list[str] = []
    for rel, text in rendered.items():
        dst = out / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.write_text(text, encoding="utf-8")
        files.append(rel)
    for src in sorted(p for p in tdir.rglob("*") if p.is_file() and p.suffix != ".j2" and not p.name.lower().startswith("readme")):
        rel = src.relative_to(tdir).as_posix()
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, out / rel)
        files.append(rel)
    files += _support_files(topo, out, ctx)
    return Rendered(out, sorted(set(files)), ctx)


def _support_files(topo, out: Path, ctx: dict[str, Any]) -> list[str]:
    """The files the services mount, besides the rendered templates."""
    files = []
    # The project's name for docker-compose 1.29 and v2 alike (1.29 refuses a top-level `name:`).
    (out / ".env").write_text(f"COMPOSE_PROJECT_NAME={ctx['project_name']}\n", encoding="utf-8")
    files.append(".env")
    (out / "topology.yaml").write_text(dump_yaml(topo), encoding="utf-8")
    files.append("topology.yaml")
    (out / "nbox").mkdir(exist_ok=True)
    cluster = {
        "cluster": ctx["cluster_name"],
        "agent_port": ctx["agent_port"],
        "nodes": [{k: n[k] for k in ("name", "service", "address", "role", "shape")} for n in ctx["nodes"]],
    }
    (out / "nbox" / "cluster.json").write_text(json.dumps(cluster, indent=1) + "\n", encoding="utf-8")
    files.append("nbox/cluster.json")
    dash = out / "dashboards"
    dash.mkdir(exist_ok=True)
    root = repo_root()
    if root is not None and (root / "dashboards").is_dir():
        for src in sorted((root / "dashboards").glob("*.json")):
            shutil.copyfile(src, dash / src.name)
            files.append(f"dashboards/{src.name}")
    for sub in ("dashboards", "datasources"):
        (out / "grafana" / "provisioning" / sub).mkdir(parents=True, exist_ok=True)
    if not (out / "prometheus.yml").exists():
        # Until a prometheus.yml.j2 exists, the scrape configuration comes straight from the context.
        conf = {
            "global": {"scrape_interval": ctx["scrape_interval"]},
            "scrape_configs": [
                {"job_name": t["job"], "static_configs": [{"targets": t["targets"], "labels": t["labels"]}]}
                for t in ctx["scrape_targets"]
            ],
        }
        (out / "prometheus.yml").write_text(yaml.safe_dump(conf, sort_keys=False), encoding="utf-8")
        files.append("prometheus.yml")
    return files
