"""The netns runtime's plan: what a topology becomes (namespaces, links, addresses, routes), creating nothing.

Design (how every node reaches every other along the topology's route):

- A node is a namespace; its *node address* (``10.77.0.1`` for node 0 by default) sits on
  ``lo`` as a /32, so it does not depend on which NIC a route uses.
- A switch is a namespace with a bridge ``br0``. Its ports towards NICs are bridge ports
  (one L2 segment per switch, like a ToR's VLAN), and ``br0`` has an address (its SVI).
  Switch-to-switch links and NIC-to-NIC links (rings, explicit links) are routed /30s.
  Single-switch clusters are therefore pure L2; fat-trees and rail fabrics route between
  switches, the way data-centre leaf/spine fabrics do.
- For every ordered pair of nodes (A, B) the topology's route between their first ranks
  (``ClusterGraph.route_vertices``, ECMP hash included) is walked and each L3 hop gets a
  ``B/32 via <next hop>`` entry. Where one namespace forwards traffic for the same
  destination to different next hops depending on the source (ECMP by pair), the majority
  goes in the main table and the others in a per-source table chosen by a ``from A``
  rule. Sources put their node address as ``src`` so those rules see it.

The plan is pure (``plan_network``), so the docker runtime, compose and the tests reuse it;
``netns.build_network`` makes it real.
"""

from __future__ import annotations

import ipaddress
from collections import Counter, defaultdict
from dataclasses import dataclass, field

from ..errors import InputError
from .rtnetlink import RT_TABLE_MAIN

__all__ = [
    "NetworkPlan",
    "PlannedLink",
    "PlannedNs",
    "End",
    "plan_network",
    "ns_name",
    "ns_role",
    "link_name",
    "DEFAULT_SUBNET",
    "MAX_CLUSTER_NODES",
    "check_cluster_size",
]

DEFAULT_SUBNET = "10.77.0.0/16"
# A namespace per node and, in each, a route to every other node: the plan grows as nodes
# squared (1,024 nodes: 43 s and 0.95 GB to plan on the 2-core dev machine; 10,000 did not end).
MAX_CLUSTER_NODES = 1024


@dataclass
class End:
    """One end of a link: an interface in a namespace."""

    ns: str
    ifname: str
    index: int
    vertex: str
    addr: str | None = None
    prefix: int = 32
    bridged: bool = False  # a bridge port: no address, switched rather than routed


@dataclass
class PlannedLink:
    """A physical network link of the topology, realised as one veth pair."""

    id: int
    name: str
    a: End
    b: End
    rate: float  # bytes/s, each direction
    delay_ab: float
    delay_ba: float
    jitter: float
    loss: float

    def as_dict(self) -> dict:
        """JSON-friendly form (state file, agent API)."""
        return {
            "id": self.id,
            "name": self.name,
            "a": vars(self.a),
            "b": vars(self.b),
            "rate": self.rate,
            "delay_ab": self.delay_ab,
            "delay_ba": self.delay_ba,
            "jitter": self.jitter,
            "loss": self.loss,
        }


@dataclass
class PlannedNs:
    """A namespace of the plan: a node (host) or a switch."""

    name: str
    kind: str  # "host" or "switch"
    vertex: str
    index: int
    address: str | None = None  # node address (hosts) or SVI (switches with a bridge)
    prefix: int = 32
    next_index: int = 2  # the next free ifindex (lo is 1)


@dataclass
class NetworkPlan:
    """Everything the netns runtime will create for one topology."""

    cluster: str
    subnet: str
    namespaces: list[PlannedNs]
    links: list[PlannedLink]
    bridges: dict[str, int]  # switch namespace -> ifindex of br0
    routes: dict[str, list[tuple[str, str, int, str | None, int]]]  # ns -> (dst, gw, oif, prefsrc, table)
    rules: dict[str, list[tuple[str, int, int]]]  # ns -> (src, table, priority)
    node_ns: dict[str, str] = field(default_factory=dict)  # node name -> namespace
    node_addr: dict[str, str] = field(default_factory=dict)  # node name -> node address
    paths: dict[tuple[str, str], list[str]] = field(default_factory=dict)  # (node, node) -> namespaces crossed at L3
    pair_links: dict[tuple[str, str], list[tuple[int, int]]] = field(default_factory=dict)  # (node, node) -> (link id, 0 a>b | 1 b>a)

    @property
    def hosts(self) -> list[PlannedNs]:
        """The node namespaces, in node order."""
        return [n for n in self.namespaces if n.kind == "host"]

    def route_count(self) -> int:
        """How many routes the plan installs."""
        return sum(len(v) for v in self.routes.values())


def ns_name(cluster: str, kind: str, index: int) -> str:
    """The namespace name of node (``h``) or switch (``s``) ``index`` of a cluster."""
    return f"nbx-{cluster}-{kind}{index}"


def ns_role(name: str) -> tuple[str, int] | None:
    """``("h", k)`` for node k's namespace, ``("s", j)`` for switch j's (the inverse of ``ns_name``); None for others."""
    head, sep, tail = name.rpartition("-")
    if not (sep and head.startswith("nbx-") and tail[:1] in ("h", "s") and tail[1:].isdigit()):
        return None
    return tail[0], int(tail[1:])


def link_name(u: str, v: str) -> str:
    """A URL- and shell-friendly link name: ``node0:0--switch`` (NIC 0 of node0 to switch)."""

    def vname(x: str) -> str:
        node, sep, nic = x.partition("/nic")
        return f"{node}:{nic}" if sep else x

    return f"{vname(u)}--{vname(v)}"


class _Allocator:
    """Aligned blocks out of the cluster subnet."""

    def __init__(self, subnet: str):
        try:
            self.net = ipaddress.IPv4Network(subnet, strict=False)
        except ValueError as exc:
            raise InputError(f"--subnet: {exc}") from None
        self.cursor = int(self.net.network_address)
        self.end = int(self.net.broadcast_address) + 1

    def block(self, size: int) -> ipaddress.IPv4Network:
        """The next free block that holds ``size`` addresses, aligned to its size."""
        bits = max(2, (size - 1).bit_length())
        size = 1 << bits
        start = (self.cursor + size - 1) // size * size
        if start + size > self.end:
            raise InputError(f"--subnet: {self.net} is too small for this topology's addresses")
        self.cursor = start + size
        return ipaddress.IPv4Network((start, 32 - bits))


def check_cluster_size(topo) -> None:
    """Refuse (InputError) a topology with more nodes than a cluster of namespaces or containers holds."""
    if len(topo.nodes) > MAX_CLUSTER_NODES:
        raise InputError(f"{topo.source}: cluster: {len(topo.nodes)} nodes; nbox up brings up at most "
                         f"{MAX_CLUSTER_NODES} (one namespace each; nbox run and show take up to the topology bounds)")


def plan_network(topo, cluster: str, subnet: str = DEFAULT_SUBNET) -> NetworkPlan:
    """Turn a topology into namespaces, links, addresses and routes (pure: creates nothing)."""
    from ..topology.graph import ClusterGraph

    check_cluster_size(topo)

    g = ClusterGraph(topo)
    g.materialize(ranks=False)  # every namespace is planned from its host and NICs; ranks need none
    gg = g.g
    alloc = _Allocator(subnet)
    namespaces: list[PlannedNs] = []
    vertex_ns: dict[str, PlannedNs] = {}
    ids = alloc.block(len(topo.nodes) + 2)
    node_addr: dict[str, str] = {}
    for node in topo.nodes:
        p = PlannedNs(ns_name(cluster, "h", node.index), "host", node.name, node.index, str(ids[node.index + 1]), 32)
        namespaces.append(p)
        vertex_ns[node.name] = p
        node_addr[node.name] = p.address
    for j, sw in enumerate(g.switches):
        p = PlannedNs(ns_name(cluster, "s", j), "switch", sw, j)
        namespaces.append(p)
        vertex_ns[sw] = p

    def owner(v: str) -> PlannedNs:
        d = gg.nodes[v]
        return vertex_ns[topo.nodes[d["node"]].name] if d["kind"] == "nic" else vertex_ns[v]

    net_links = [a for a in g.physical_links("net")]
    # Per NIC, how many links it has (a NIC with one link is `nicK`, else `nicK-m`).
    nic_links: dict[str, list[int]] = defaultdict(list)
    for li, a in enumerate(net_links):
        for v in (a.src, a.dst):
            if gg.nodes[v]["kind"] == "nic":
                nic_links[v].append(li)
    port_no: Counter = Counter()
    bridges: dict[str, int] = {}
    seg_members: dict[str, list[End]] = defaultdict(list)
    links: list[PlannedLink] = []
    vertex_end: dict[tuple[str, str], End] = {}  # (vertex, peer vertex) -> the vertex's end
    arc_link: dict[tuple[str, str], tuple[int, int]] = {}

    def make_end(v: str, peer: str, li: int) -> End:
        p = owner(v)
        kind = gg.nodes[v]["kind"]
        if kind == "nic":
            k = gg.nodes[v]["nic"]
            mine = nic_links[v]
            ifname = f"nic{k}" if len(mine) == 1 else f"nic{k}-{mine.index(li)}"
        else:
            ifname = f"p{port_no[v]}"
            port_no[v] += 1
        idx = p.next_index
        p.next_index += 1
        bridged = kind == "switch" and gg.nodes[peer]["kind"] == "nic"
        return End(p.name, ifname, idx, v, bridged=bridged)

    for li, arc in enumerate(net_links):
        u, v = arc.src, arc.dst
        ea, eb = make_end(u, v, li), make_end(v, u, li)
        if ea.index == eb.index:
            # Peers with one ifindex make the kernel batch their link-up event (wait_links_up).
            eb.index = owner(v).next_index
            owner(v).next_index += 1
        back = gg.edges[v, u]
        links.append(
            PlannedLink(li, link_name(u, v), ea, eb, arc.rate, arc.latency, back["latency"], arc.jitter, arc.loss)
        )
        vertex_end[(u, v)] = ea
        vertex_end[(v, u)] = eb
        arc_link[(u, v)] = (li, 0)
        arc_link[(v, u)] = (li, 1)
        for e, other in ((ea, eb), (eb, ea)):
            if e.bridged:
                seg_members[e.vertex].append(other)

    # Addresses: one segment per switch with NIC ports (its SVI first), a /30 per routed link.
    for sw in g.switches:
        members = seg_members.get(sw)
        if not members:
            continue
        p = vertex_ns[sw]
        block = alloc.block(len(members) + 3)
        hosts = list(block.hosts()) if block.prefixlen < 31 else list(block)
        p.address, p.prefix = str(hosts[0]), block.prefixlen
        bridges[p.name] = p.next_index
        p.next_index += 1
        for i, e in enumerate(members):
            e.addr, e.prefix = str(hosts[i + 1]), block.prefixlen
    for lk in links:
        if lk.a.bridged or lk.b.bridged:
            continue
        block = alloc.block(4)
        lk.a.addr, lk.a.prefix = str(block[1]), 30
        lk.b.addr, lk.b.prefix = str(block[2]), 30

    # Routes: walk each node pair's topology route and give every L3 hop a next hop.
    decisions: dict[tuple[str, str], dict[str, tuple[str, int]]] = defaultdict(dict)  # (ns, dst) -> src -> (gw, oif)
    paths: dict[tuple[str, str], list[str]] = {}
    pair_links: dict[tuple[str, str], list[tuple[int, int]]] = {}
    for na in topo.nodes:
        for nb in topo.nodes:
            if na.index == nb.index:
                continue
            net = g.network_route(na.first_rank, nb.first_rank)
            src, dst = node_addr[na.name], node_addr[nb.name]
            pair_links[(na.name, nb.name)] = [arc_link[(x, y)] for x, y in zip(net, net[1:])]
            l3 = [owner(net[0]).name]
            i = 0
            while i < len(net) - 1:
                here, nxt = net[i], net[i + 1]
                out = vertex_end[(here, nxt)]
                into = vertex_end[(nxt, here)]
                if gg.nodes[here]["kind"] == "switch" and out.bridged:
                    # Leaving a switch towards a NIC: through br0 to the NIC's segment address.
                    decisions[(owner(here).name, dst)][src] = (into.addr, bridges[owner(here).name])
                    i += 1
                    l3.append(owner(nxt).name)
                    continue
                if into.bridged:
                    # Entering a switch's bridge: either crossing it at L2 to a NIC, or to its SVI.
                    after = net[i + 2]
                    sw_ns = owner(nxt)
                    if gg.nodes[after]["kind"] == "nic":
                        gw = vertex_end[(after, nxt)].addr
                        decisions[(owner(here).name, dst)][src] = (gw, out.index)
                        l3.append(owner(after).name)
                        i += 2
                        continue
                    decisions[(owner(here).name, dst)][src] = (sw_ns.address, out.index)
                    l3.append(sw_ns.name)
                    i += 1
                    continue
                decisions[(owner(here).name, dst)][src] = (into.addr, out.index)
                l3.append(owner(nxt).name)
                i += 1
            paths[(na.name, nb.name)] = l3

    routes: dict[str, list] = defaultdict(list)
    rules: dict[str, list] = defaultdict(list)
    host_by_addr = {p.address: p for p in namespaces if p.kind == "host"}
    for (ns, dst), by_src in decisions.items():
        own = next((p for p in namespaces if p.name == ns), None)
        own_addr = own.address if own is not None and own.kind == "host" else None
        counts = Counter(by_src.values())
        main = by_src[own_addr] if own_addr in by_src else counts.most_common(1)[0][0]
        routes[ns].append((dst, main[0], main[1], own_addr, RT_TABLE_MAIN))
        for src, choice in by_src.items():
            if choice != main:
                table = 1000 + host_by_addr[src].index
                routes[ns].append((dst, choice[0], choice[1], None, table))
                if (src, table, 1000 + host_by_addr[src].index) not in rules[ns]:
                    rules[ns].append((src, table, 1000 + host_by_addr[src].index))
    return NetworkPlan(
        cluster, str(alloc.net), namespaces, links, bridges, dict(routes), dict(rules),
        {n.name: vertex_ns[n.name].name for n in topo.nodes}, node_addr, paths, pair_links,
    )
