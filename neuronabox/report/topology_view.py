"""``nbox show``: a topology as rich tables, a PNG drawing or Graphviz dot."""

from __future__ import annotations

import math
import re
from collections import Counter
from pathlib import Path

from rich.table import Table

from ..topology import Topology
from ..errors import InputError
from ..topology.graph import EAGER_MAX_RANKS, ClusterGraph
from ..units import format_bandwidth, format_duration

__all__ = ["summary_tables", "route_table", "draw", "write_png", "write_dot", "check_drawable"]

# Above this many vertices the drawing collapses each node's ranks and NICs into the host.
_FULL_DRAWING_LIMIT = 160


def summary_tables(topo: Topology, graph: ClusterGraph) -> list[Table]:
    """The cluster at a glance: one summary table and one table of node kinds."""
    em = topo.emulation
    wi = topo.whatif
    t = Table(title=f"topology {topo.name}", show_header=False, title_justify="left")
    t.add_column("what", style="bold")
    t.add_column("value")
    t.add_row("file", topo.source)
    if topo.spec.description:
        t.add_row("description", topo.spec.description)
    t.add_row("world size", f"{topo.world_size} ranks on {len(topo.nodes)} nodes")
    t.add_row("real ranks", ", ".join(map(str, em.real_ranks)))
    t.add_row("network", _network_line(topo))
    t.add_row("links", f"{graph.network_link_count()} network links, {len(graph.switches)} switches")
    t.add_row("library / model", f"{em.library} / {em.model} (algorithm {em.algorithm}, protocol {em.protocol})")
    knobs = []
    if wi.inject:
        knobs.append("inject " + ", ".join(f"{k.value}=+{format_duration(v)}" for k, v in wi.inject.items()))
    if wi.latency_scale != 1:
        knobs.append(f"latency x{wi.latency_scale:g}")
    if wi.bandwidth_scale != 1:
        knobs.append(f"bandwidth x{wi.bandwidth_scale:g}")
    if wi.stragglers:
        knobs.append("stragglers " + ", ".join(f"rank {r} x{f:g}" for r, f in wi.stragglers.items()))
    if wi.world_size:
        knobs.append(f"world size {wi.world_size}")
    t.add_row("what-if", "; ".join(knobs) if knobs else "none")

    kinds = Counter(
        (n.ranks, n.device, n.compute_slowdown, n.nics, n.fabric.value, n.intra_bandwidth, n.intra_latency) for n in topo.nodes
    )
    k = Table(title="nodes", title_justify="left")
    for col in ("count", "ranks", "device", "slow-down", "NICs", "fabric", "fabric bw", "fabric latency", "examples"):
        k.add_column(col, justify="right" if col in ("count", "ranks", "NICs", "slow-down") else "left")
    for key, count in kinds.items():
        ranks, device, slow, nics, fabric, bw, lat = key
        names = [n.name for n in topo.nodes if (n.ranks, n.device, n.compute_slowdown, n.nics, n.fabric.value, n.intra_bandwidth, n.intra_latency) == key]
        example = ", ".join(names[:3]) + (", …" if len(names) > 3 else "")
        k.add_row(
            str(count), str(ranks), device, f"{slow:g}", str(nics), fabric,
            format_bandwidth(bw, bits=False), format_duration(lat), example,
        )
    return [t, k]


def _network_line(topo: Topology) -> str:
    net = topo.network
    link = net.link
    text = f"{net.type}: {format_bandwidth(link.bandwidth)} per link, {format_duration(link.latency)} per link"
    if link.jitter:
        text += f", jitter {format_duration(link.jitter)}"
    if link.loss:
        text += f", loss {link.loss:.3%}"
    if net.type == "fat-tree" and net.fat_tree:
        text += f", oversubscription {net.fat_tree.oversubscription:g}:1"
        if net.fat_tree.k:
            text += f", k={net.fat_tree.k}"
    return text


def route_table(graph: ClusterGraph, src: int, dst: int) -> Table:
    """The hops of the route from rank ``src`` to rank ``dst``."""
    verts = graph.route_vertices(src, dst)
    t = Table(title=f"route rank {src} -> rank {dst}", title_justify="left")
    for col in ("from", "to", "kind", "bandwidth", "latency"):
        t.add_column(col)
    for u, v in zip(verts, verts[1:]):
        d = graph.g.edges[u, v]
        bw = "unlimited" if d["rate"] == float("inf") else format_bandwidth(d["rate"])
        t.add_row(u, v, d["kind"], bw, format_duration(d["latency"]))
    t.caption = (
        f"total latency {format_duration(graph.route_latency(src, dst))}, "
        f"bottleneck {format_bandwidth(graph.route_bandwidth(src, dst))} of payload"
    )
    return t


def check_drawable(graph: ClusterGraph, flag: str) -> None:
    """Refuse (InputError) to draw a lazily built graph: every rank would become a vertex of the file."""
    if graph.lazy:
        raise InputError(f"{flag}: {graph.topo.world_size} ranks ({graph.vertex_count()} vertices) is too large "
                         f"to draw; drawings hold at most {EAGER_MAX_RANKS} ranks (try --world-size {EAGER_MAX_RANKS})")


def write_dot(graph: ClusterGraph, path: str | Path) -> None:
    """Write the graph as Graphviz dot."""
    Path(path).write_text(graph.to_dot(), encoding="utf-8")


def _drawing_graph(graph: ClusterGraph):
    import networkx as nx

    g = graph.g
    if g.number_of_nodes() <= _FULL_DRAWING_LIMIT:
        return nx.Graph(g), False
    # Collapse ranks and NICs into their host: a 256-GPU cluster stays legible.
    owner = {}
    for v, d in g.nodes(data=True):
        owner[v] = graph.topo.nodes[d["node"]].name if d["kind"] in ("rank", "nic") else v
    h = nx.Graph()
    for v, d in g.nodes(data=True):
        if owner[v] == v:
            h.add_node(v, **d)
    for u, v in g.edges():
        a, b = owner[u], owner[v]
        if a != b:
            h.add_edge(a, b)
    return h, True


_LAYER = {"core": 0, "spine": 0, "switch": 0, "agg": 1, "edge": 2, "leaf": 2}
_DIGITS = re.compile(r"(\d+)")


def _natural(name: str) -> list:
    return [int(p) if p.isdigit() else p for p in _DIGITS.split(name)]


def _layered_positions(h, collapsed: bool) -> dict[str, tuple[float, float]]:
    """Switch tiers on top, then NICs, hosts and ranks; each tier sorted by name and spread evenly."""
    layers: dict[int, list[str]] = {}
    for v, d in h.nodes(data=True):
        if d["kind"] == "switch":
            layer = _LAYER.get(d.get("role", "switch"), 0)
        else:
            layer = {"nic": 3, "host": 3 if collapsed else 4, "rank": 5}[d["kind"]]
        layers.setdefault(layer, []).append(v)
    pos = {}
    for layer, members in layers.items():
        members.sort(key=_natural)
        for i, v in enumerate(members):
            pos[v] = ((i + 0.5) / len(members), -float(layer))
    return pos


def draw(graph: ClusterGraph):
    """The cluster drawing (layered: switches above hosts) as a matplotlib Figure; ``write_png`` saves it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import networkx as nx

    h, collapsed = _drawing_graph(graph)
    ring = graph.topo.network.type in ("ring", "links")
    if ring:
        pos = nx.kamada_kawai_layout(h) if h.number_of_nodes() < 400 else nx.spring_layout(h, seed=1)
    else:
        pos = _layered_positions(h, collapsed)
    colors = {"switch": "#d62728", "host": "#1f77b4", "nic": "#2ca02c", "rank": "#ff7f0e"}
    n = h.number_of_nodes()
    size = max(20, 900 // max(1, n // 10))
    width = min(40, 8 + n / 12)
    fig, ax = plt.subplots(figsize=(width, 8))
    nx.draw_networkx_edges(h, pos, ax=ax, width=0.6, alpha=0.5)
    for kind, color in colors.items():
        nodes = [v for v, d in h.nodes(data=True) if d["kind"] == kind]
        if nodes:
            nx.draw_networkx_nodes(h, pos, nodelist=nodes, node_color=color, node_size=size, ax=ax, label=kind)
    if ring:
        if n <= 40:
            nx.draw_networkx_labels(h, pos, font_size=6, ax=ax)
    else:
        _layer_labels(ax, pos, width)
    topo = graph.topo
    ax.set_title(
        f"{topo.name}: {topo.world_size} ranks on {len(topo.nodes)} nodes, {topo.network.type}"
        + (" (ranks and NICs drawn inside their hosts)" if collapsed else "")
    )
    ax.legend(loc="upper right", fontsize=8, markerscale=0.6)
    ax.axis("off")
    fig.tight_layout()
    return fig


_FONT_PT = 6.5
_CHAR_IN = _FONT_PT * 0.62 / 72  # a character's width at that size, in inches (DejaVu Sans, about)
_LINE_IN = _FONT_PT * 1.35 / 72  # a line's height


def _layer_labels(ax, pos: dict[str, tuple[float, float]], fig_width_in: float) -> None:
    """Label each tier so that no two labels overlap: level when they fit, else upright below the nodes.

    A tier too dense even for upright labels (hundreds of hosts) gets every k-th one.
    """
    layers: dict[float, list[str]] = {}
    for v, (_, y) in pos.items():
        layers.setdefault(y, []).append(v)
    usable = fig_width_in * 0.85  # the axes' share of the figure after tight_layout, with the legend
    for y, members in layers.items():
        members.sort(key=lambda v: pos[v][0])
        pitch = usable / len(members)  # inches between neighbours
        longest = max(len(v) for v in members) * _CHAR_IN
        if longest <= pitch * 0.9:
            for v in members:
                ax.text(pos[v][0], y, v, fontsize=_FONT_PT, ha="center", va="center", zorder=5)
            continue
        step = max(1, math.ceil(_LINE_IN / pitch))
        for v in members[::step]:
            ax.text(pos[v][0], y - 0.09, v, fontsize=_FONT_PT, ha="center", va="top", rotation=90, zorder=5)
    lo = min(layers)
    ax.set_ylim(lo - 0.6, max(layers) + 0.25)  # room for the upright labels under the lowest tier


def write_png(graph: ClusterGraph, path: str | Path) -> None:
    """Draw the cluster (layered: switches above hosts) into a PNG file."""
    import matplotlib.pyplot as plt

    fig = draw(graph)
    fig.savefig(path, dpi=110)
    plt.close(fig)
