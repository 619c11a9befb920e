"""Synthesis: a resolved topology becomes a directed graph of hosts, ranks, NICs, switches and links.

Every physical link is two arcs (full duplex, each with the link's bandwidth, times the share
that carries payload: see ``payload_efficiency``). Arc ids index
flat arrays (``capacity``, ``latency``) so that models can work on numbers, not dicts.

Graph vertices (strings, readable in dot/PNG output):
- ``node0``           the host; it is also the intra-node fabric hub (NVSwitch, PCIe switch, memory)
- ``node0/r3``        rank 3 of the node (local index), a GPU or a CPU process
- ``node0/nic1``      a NIC
- switches by role: ``switch``, ``edge-p0-1``, ``agg-p0-1``, ``core-0-1``, ``rail2``, ``spine0``, or a listed name

Routes between ranks of one node cross the fabric (rank -> host -> rank). Between nodes they
leave through the source rank's NIC, cross the network along a shortest path (by latency;
equal-cost paths are chosen per hop by a hash of the endpoints, like ECMP) and enter the
destination rank's NIC. On rail-optimized networks a rank whose NIC is on another rail than
the destination's first crosses the fabric to the NIC on the right rail (NCCL's PXN).

Large worlds (more than ``EAGER_MAX_RANKS`` ranks) are built lazily: the switches and the links
between them at once, a node's host, NICs and uplinks when a route first enters it, and a rank
and its links when a route starts or ends there (``materialize`` builds the rest). Vertices, arcs and routes are the same as an eager build's (arc
ids are numbered in build order instead), so a 10 M-rank world costs what its switches and the
few nodes asked about cost, not 10 M vertices. Rings and explicit links, whose NICs forward,
build every host and NIC at once and only the ranks lazily.
"""

from __future__ import annotations

import itertools
import zlib
from dataclasses import dataclass
from typing import Iterable

import networkx as nx
import numpy as np

from ..errors import TopologyError
from .resolve import Topology, effective_link
from .schema import LinkSpec

__all__ = ["ClusterGraph", "LinkInfo", "EAGER_MAX_RANKS"]

# NIC <-> host arcs stand for PCIe to the NIC, which these models do not make a bottleneck.
UNLIMITED = float("inf")
# Up to this many ranks every vertex is built at once (what drawings and `nbox up` want); above
# it nodes are built on demand. 16 Ki ranks build in about a second; 1 M took 44 s and 3.1 GB.
EAGER_MAX_RANKS = 16_384
# Network types whose NICs each hang off one switch: a NIC's uplink is arithmetic, so the
# node that owns it can wait until it is needed.
_UPLINK_TYPES = ("switch", "fat-tree", "rail-optimized")


@dataclass(frozen=True)
class LinkInfo:
    """One directed arc."""

    id: int
    src: str
    dst: str
    kind: str  # "fabric", "pcie" or "net"
    capacity: float  # bytes/s
    latency: float  # seconds
    jitter: float
    loss: float
    rate: float  # the link's line rate in bytes/s (what shaping sets); capacity is its payload share


class ClusterGraph:
    """The synthesized cluster: vertices, arcs with capacities and latencies, and rank-to-rank routes."""

    def __init__(self, topo: Topology, lazy: bool | None = None):
        self.topo = topo
        wi = topo.whatif
        self.payload_efficiency = payload_efficiency(topo)
        self._bw_scale = wi.bandwidth_scale
        self._lat_scale = wi.latency_scale
        self.lazy = topo.world_size > EAGER_MAX_RANKS if lazy is None else lazy
        self.g = nx.DiGraph()
        self._arcs: list[LinkInfo] = []
        # (u, v) -> arc id: networkx's edge view is rebuilt after every added edge, so a lazy graph
        # that grows between routes paid ~50 us a hop looking ids up through it.
        self._arc_id: dict[tuple[str, str], int] = {}
        self._capacity: list[float] = []
        self._latency: list[float] = []
        self._arrays: tuple[np.ndarray, np.ndarray] | None = None
        self.rank_vertex = _PerRank(topo, lambda node, local: f"{node.name}/r{local}")
        self.rank_nic = _PerRank(topo, lambda node, local: f"{node.name}/nic{(local * node.nics) // node.ranks}")
        self.nic_rail: dict[str, int] = {}
        self.switches: list[str] = []
        self._attach: dict[str, str] = {}
        # Per node: 0 nothing built, 1 host and NICs (and the ranks routes asked for), 2 every rank.
        self._built = bytearray(len(topo.nodes))
        self._uplinks = topo.network.type in _UPLINK_TYPES
        if not self.lazy:
            self._build_hosts()
        elif not self._uplinks:  # NICs that forward: routing needs every one of them from the start
            for node in topo.nodes:
                self._build_host(node)
        self._build_network()
        # The network links built so far; a lazy build adds one per NIC of each node it builds.
        self._eager_net_links = sum(1 for _ in self.physical_links("net"))
        self._route_cache: dict[tuple[int, int], tuple[int, ...]] = {}
        self._pred_cache: dict[str, dict[str, list[str]]] = {}
        self._prepare_routing()

    @property
    def capacity(self) -> np.ndarray:
        """Every arc's capacity in bytes/s, indexed by arc id."""
        return self._numbers()[0]

    @property
    def latency(self) -> np.ndarray:
        """Every arc's latency in seconds, indexed by arc id."""
        return self._numbers()[1]

    def _numbers(self) -> tuple[np.ndarray, np.ndarray]:
        # Rebuilt only when a lazy build added arcs since the last call.
        if self._arrays is None or len(self._arrays[0]) != len(self._arcs):
            self._arrays = (np.array(self._capacity, dtype=float), np.array(self._latency, dtype=float))
        return self._arrays

    # ---- construction -------------------------------------------------------------------
    def _add_vertex(self, name: str, **attrs) -> None:
        self.g.add_node(name, **attrs)

    def _add_link(self, a: str, b: str, kind: str, capacity: float, latency: float, jitter=0.0, loss=0.0) -> None:
        rate = capacity
        if kind == "net":
            rate *= self._bw_scale  # what a shaper sets on the link
            capacity = rate * self.payload_efficiency  # what collective bytes get of it
        latency *= self._lat_scale
        for u, v in ((a, b), (b, a)):
            lat = latency
            if kind == "net" and self.g.nodes[u].get("kind") == "switch":
                lat += self.topo.network.switch_latency * self._lat_scale
            arc = LinkInfo(len(self._arcs), u, v, kind, capacity, lat, jitter, loss, rate)
            self._arcs.append(arc)
            self._arc_id[u, v] = arc.id
            self._capacity.append(capacity)
            self._latency.append(lat)
            self.g.add_edge(u, v, id=arc.id, kind=kind, capacity=capacity, rate=rate, latency=lat, jitter=jitter, loss=loss)

    def _build_hosts(self) -> None:
        for node in self.topo.nodes:
            self._build_host(node)
            self._build_ranks(node)

    def _build_host(self, node) -> None:
        """The node's host vertex, its NICs and their links to the host (and, lazily, to their switch)."""
        self._add_vertex(node.name, kind="host", node=node.index, device=node.device, fabric=node.fabric.value)
        for nic in range(node.nics):
            v = f"{node.name}/nic{nic}"
            self._add_vertex(v, kind="nic", node=node.index, nic=nic)
            self.nic_rail[v] = nic
            self._add_link(node.name, v, "pcie", UNLIMITED, 0.0)
            if self.lazy and self._uplinks:
                sw = self._uplink(node, nic)
                self._net(v, sw, self.topo.network.link)
                self._attach[v] = sw
        self._built[node.index] = 1

    def _build_ranks(self, node) -> None:
        for local in range(node.ranks):
            self._build_rank(node, local)
        self._built[node.index] = 2

    def _build_rank(self, node, local: int) -> None:
        rank = node.first_rank + local
        v = f"{node.name}/r{local}"
        self._add_vertex(v, kind="rank", node=node.index, rank=rank, device=node.device)
        # Half the rank-to-rank latency on each side of the hub.
        self._add_link(v, node.name, "fabric", node.intra_bandwidth, node.intra_latency / 2)
        self._add_link(v, self.rank_nic[rank], "pcie", UNLIMITED, 0.0)

    def _need(self, rank: int) -> None:
        """Build ``rank`` (and its node's host and NICs) if a lazy build has not yet."""
        node = self.topo.node_of(rank)
        if self._built[node.index] < 2 and self.rank_vertex[rank] not in self.g:
            if self._built[node.index] < 1:
                self._build_host(node)
            self._build_rank(node, rank - node.first_rank)

    def materialize(self, ranks: bool = True) -> None:
        """Build every node a lazy build left out (with ``ranks=False``: hosts and NICs only, what `nbox up` plans)."""
        for node in self.topo.nodes:
            if self._built[node.index] < 1:
                self._build_host(node)
            if ranks and self._built[node.index] < 2:
                for local in range(node.ranks):
                    if f"{node.name}/r{local}" not in self.g:
                        self._build_rank(node, local)
                self._built[node.index] = 2

    def _uplink(self, node, nic: int) -> str:
        """The switch NIC ``nic`` of ``node`` plugs into (network types in ``_UPLINK_TYPES``)."""
        kind = self.topo.network.type
        if kind == "switch":
            return "switch"
        if kind == "rail-optimized":
            return f"rail{nic}"
        p, e = divmod((self._nic_first[node.index] + nic) // self._ft_half, self._ft_half)
        return f"edge-p{p}-{e}"

    def _switch(self, name: str, role: str, **attrs) -> str:
        self._add_vertex(name, kind="switch", role=role, **attrs)
        self.switches.append(name)
        return name

    def _net(self, a: str, b: str, spec: LinkSpec) -> None:
        self._add_link(a, b, "net", spec.bandwidth, spec.latency, spec.jitter, spec.loss)

    def _all_nics(self) -> list[str]:
        return [f"{n.name}/nic{i}" for n in self.topo.nodes for i in range(n.nics)]

    def _eager_nics(self) -> list[str]:
        """The NICs whose uplinks are built with the network: all of them, none in a lazy build."""
        return [] if self.lazy else self._all_nics()

    def _build_network(self) -> None:
        net = self.topo.network
        kind = net.type
        if kind == "switch":
            sw = self._switch("switch", "switch")
            for nic in self._eager_nics():
                self._net(nic, sw, net.link)
        elif kind == "ring":
            self._build_ring(net.link)
        elif kind == "fat-tree":
            self._build_fat_tree(net)
        elif kind == "rail-optimized":
            self._build_rail(net)
        else:
            self._build_links(net)

    def _build_ring(self, link: LinkSpec) -> None:
        nodes = self.topo.nodes
        if len(nodes) < 2:
            return
        rails = max(n.nics for n in nodes)
        for rail in range(rails):
            members = [f"{n.name}/nic{rail}" for n in nodes if n.nics > rail]
            pairs = [(members[i], members[(i + 1) % len(members)]) for i in range(len(members))]
            if len(members) == 2:
                pairs = pairs[:1]
            for a, b in pairs:
                self._net(a, b, link)

    def _build_fat_tree(self, net) -> None:
        nic_count = sum(n.nics for n in self.topo.nodes)
        ft = net.fat_tree
        k = ft.k if ft and ft.k else _smallest_k(nic_count)
        over = ft.oversubscription if ft else 1.0
        half = k // 2
        self._ft_half = half
        # Global NIC index of each node's NIC 0: NICs fill edge switches in node order.
        self._nic_first = list(itertools.accumulate((n.nics for n in self.topo.nodes), initial=0))
        up = net.link.model_copy(update={"bandwidth": net.link.bandwidth / over})
        pods_used = -(-nic_count // (half * half))
        for p in range(pods_used):
            for i in range(half):
                e = self._switch(f"edge-p{p}-{i}", "edge", pod=p)
                for j in range(half):
                    a = f"agg-p{p}-{j}"
                    if a not in self.g:
                        self._switch(a, "agg", pod=p)
                    self._net(e, a, up)
        if pods_used > 1:
            for j in range(half):
                for m in range(half):
                    c = self._switch(f"core-{j}-{m}", "core")
                    for p in range(pods_used):
                        self._net(f"agg-p{p}-{j}", c, net.link)
        for g_idx, nic in enumerate(self._eager_nics()):
            p, e = divmod(g_idx // half, half)
            self._net(nic, f"edge-p{p}-{e}", net.link)

    def _build_rail(self, net) -> None:
        rails = max(n.nics for n in self.topo.nodes)
        spines = (net.rail.spines if net.rail and net.rail.spines else rails) if len(self.topo.nodes) > 1 else 0
        spine_link = effective_link(net.link, net.rail.spine_link if net.rail else None)
        leaves = [self._switch(f"rail{r}", "leaf", rail=r) for r in range(rails)]
        for s in range(spines if rails > 1 else 0):
            sp = self._switch(f"spine{s}", "spine")
            for leaf in leaves:
                self._net(leaf, sp, spine_link)
        for nic in self._eager_nics():
            self._net(nic, leaves[self.nic_rail[nic]], net.link)

    def _build_links(self, net) -> None:
        for s in net.switches:
            self._switch(s, "switch")
        for link in net.links:
            ends = [e if e in self.g and self.g.nodes[e]["kind"] == "switch" else _nic_name(e) for e in link.endpoints]
            self._net(ends[0], ends[1], effective_link(net.link, link))
        src = self.topo.source
        reach = nx.node_connected_component(self.g.to_undirected(as_view=True), self.topo.nodes[0].name)
        for n in self.topo.nodes[1:]:
            if n.name not in reach:
                raise TopologyError(src, "network.links", f"node {n.name!r} cannot reach node {self.topo.nodes[0].name!r}")

    # ---- routing --------------------------------------------------------------------------
    def _prepare_routing(self) -> None:
        # Routing runs on the forwarding part of the network: switches, plus NICs that link to
        # other NICs directly (rings, explicit links). A NIC with one link to a switch attaches there.
        forwarding: set[str] = set(self.switches)
        for nic in self.nic_rail:
            peers = [v for v in self.g.successors(nic) if self.g.nodes[v]["kind"] in ("switch", "nic")]
            if len(peers) == 1 and self.g.nodes[peers[0]]["kind"] == "switch":
                self._attach[nic] = peers[0]
            else:
                self._attach[nic] = nic
                forwarding.add(nic)
        self._rgraph = self.g.subgraph(forwarding).copy()

    def _network_path(self, a: str, b: str) -> list[str]:
        """Vertices from NIC ``a`` to NIC ``b`` through the network, ECMP-hashed per hop."""
        sa, sb = self._attach[a], self._attach[b]
        if sa == sb:
            inner = [sa]
        else:
            pred = self._pred_cache.get(sa)
            if pred is None:
                pred, _ = nx.dijkstra_predecessor_and_distance(self._rgraph, sa, weight=_route_weight)
                self._pred_cache[sa] = pred
            if sb not in pred:
                raise TopologyError(self.topo.source, "network", f"{a} cannot reach {b}")
            key = f"{a}>{b}>".encode()
            inner = [sb]
            v = sb
            while v != sa:
                options = pred[v]
                # A fresh hash per hop: reusing one value (or an LCG's low bits) makes the choices
                # of consecutive hops correlated and piles flows onto a few core links.
                v = options[zlib.crc32(key + v.encode()) % len(options)] if len(options) > 1 else options[0]
                inner.append(v)
            inner.reverse()
        path = [a] if inner[0] != a else []
        path += inner
        if path[-1] != b:
            path.append(b)
        return path

    def route_vertices(self, src: int, dst: int) -> list[str]:
        """The vertices a message from rank ``src`` to rank ``dst`` crosses, both ends included."""
        if self.lazy:
            self._need(src)
            self._need(dst)
        return self._vertices(src, dst)

    def network_route(self, src: int, dst: int) -> list[str]:
        """The NICs and switches a message from rank ``src`` to rank ``dst`` crosses (builds no rank of a lazy graph)."""
        if self.lazy:
            for node in (self.topo.node_of(src), self.topo.node_of(dst)):
                if self._built[node.index] < 1:
                    self._build_host(node)
        return [v for v in self._vertices(src, dst)[1:-1] if self.g.nodes[v]["kind"] in ("nic", "switch")]

    def _vertices(self, src: int, dst: int) -> list[str]:
        """``route_vertices`` once the two nodes' hosts (and NICs) are built."""
        topo = self.topo
        a, b = self.rank_vertex[src], self.rank_vertex[dst]
        na, nb = topo.node_of(src), topo.node_of(dst)
        if src == dst:
            return [a]
        if na.index == nb.index:
            return [a, na.name, b]
        nic_b = self.rank_nic[dst]
        nic_a = self.rank_nic[src]
        head = [a]
        if topo.network.type == "rail-optimized":
            rail = self.nic_rail[nic_b]
            if self.nic_rail[nic_a] != rail and rail < na.nics:
                nic_a = f"{na.name}/nic{rail}"
                head = [a, na.name]
        return head + self._network_path(nic_a, nic_b) + [b]

    def route(self, src: int, dst: int) -> tuple[int, ...]:
        """The arc ids from rank ``src`` to rank ``dst`` (cached)."""
        key = (src, dst)
        hit = self._route_cache.get(key)
        if hit is None:
            verts = self.route_vertices(src, dst)
            arc_id = self._arc_id
            hit = tuple(arc_id[u, v] for u, v in zip(verts, verts[1:]))
            self._route_cache[key] = hit
        return hit

    def route_latency(self, src: int, dst: int) -> float:
        """Sum of arc latencies from ``src`` to ``dst``."""
        return float(sum(self._arcs[i].latency for i in self.route(src, dst)))

    def route_bandwidth(self, src: int, dst: int) -> float:
        """The bottleneck capacity from ``src`` to ``dst`` (infinite for a rank to itself)."""
        r = self.route(src, dst)
        return min((self._arcs[i].capacity for i in r), default=UNLIMITED)

    # ---- inspection -----------------------------------------------------------------------
    @property
    def arcs(self) -> list[LinkInfo]:
        """Every directed arc, indexed by id."""
        return self._arcs

    def vertices(self, kind: str) -> list[str]:
        """Vertices of one kind: host, rank, nic or switch (of a lazy build, those built so far)."""
        return [v for v, d in self.g.nodes(data=True) if d["kind"] == kind]

    def physical_links(self, kind: str | None = None) -> Iterable[LinkInfo]:
        """One arc per physical link (the one with src < dst); of a lazy build, those built so far."""
        return (a for a in self._arcs if a.src < a.dst and (kind is None or a.kind == kind))

    def network_link_count(self) -> int:
        """How many network links the whole cluster has, built or not (a lazy build's NICs each have one)."""
        if not (self.lazy and self._uplinks):
            return sum(1 for _ in self.physical_links("net"))
        return self._eager_net_links + sum(n.nics for n in self.topo.nodes)

    def vertex_count(self) -> int:
        """How many vertices the whole cluster has, built or not."""
        if not self.lazy:
            return self.g.number_of_nodes()
        return len(self.switches) + sum(1 + n.nics + n.ranks for n in self.topo.nodes)

    def to_dot(self) -> str:
        """The graph in Graphviz dot, one undirected edge per physical link (a lazy build is built whole first)."""
        self.materialize()
        shapes = {"host": "box3d", "rank": "ellipse", "nic": "cds", "switch": "diamond"}
        lines = [f'graph "{self.topo.name}" {{', "  graph [overlap=false, splines=true];"]
        for v, d in self.g.nodes(data=True):
            label = v if d["kind"] != "rank" else f"{v}\\nrank {d['rank']}"
            lines.append(f'  "{v}" [shape={shapes[d["kind"]]}, label="{label}"];')
        for a in self.physical_links():
            attrs = f'label="{_link_label(a)}"' if a.kind != "pcie" else "style=dotted"
            lines.append(f'  "{a.src}" -- "{a.dst}" [{attrs}];')
        lines.append("}")
        return "\n".join(lines) + "\n"


# Ethernet header, IPv4 and TCP with timestamps: what each full frame spends besides payload.
_ETHERNET_HEADER = 14
_TCP_IP_HEADERS = 20 + 32


def payload_efficiency(topo: Topology) -> float:
    """The share of a network link's rate that carries collective bytes.

    gloo moves data over TCP: a full frame of MTU + 14 bytes carries MTU - 52 bytes of payload
    (1448 of 1514 at MTU 1500), and a rate limiter counts whole frames. Collectives send both
    ways at once, so each direction also carries the delayed ACKs (one 66-byte frame per two
    data frames) of the stream coming the other way: 1448 / (1514 + 33) = 93.6% at MTU 1500.
    NCCL's transports (RDMA, 4 KiB and larger packets) lose well under 1% and are left whole.
    """
    if topo.emulation.library != "gloo":
        return 1.0
    mtu = topo.network.mtu
    ack = _ETHERNET_HEADER + _TCP_IP_HEADERS
    return (mtu - _TCP_IP_HEADERS) / (mtu + _ETHERNET_HEADER + ack / 2)


def _link_label(a: LinkInfo) -> str:
    from ..units import format_bandwidth, format_duration

    return f"{format_bandwidth(a.rate)} {format_duration(a.latency)}"


def _route_weight(u: str, v: str, data: dict) -> float:
    # Latency first; a tiny per-hop cost makes equal-latency paths prefer fewer hops.
    return data["latency"] + 1e-12


def _nic_name(endpoint: str) -> str:
    name, _, nic = endpoint.partition(":")
    return f"{name}/nic{nic or 0}"


def _smallest_k(hosts: int) -> int:
    k = 2
    while k**3 // 4 < hosts:
        k += 2
    return k


class _PerRank:
    """A per-rank name computed from the rank's node (``rank_vertex``, ``rank_nic``), held as a rule, not a list."""

    __slots__ = ("_topo", "_name")

    def __init__(self, topo: Topology, name):
        self._topo = topo
        self._name = name

    def __len__(self) -> int:
        return self._topo.world_size

    def __getitem__(self, rank: int) -> str:
        if rank < 0:
            rank += self._topo.world_size
        node = self._topo.node_of(rank)
        return self._name(node, rank - node.first_rank)

    def __iter__(self):
        for node in self._topo.nodes:
            for local in range(node.ranks):
                yield self._name(node, local)
