"""Synthesis: the graph has the right parts, and routes follow the topology."""

import pytest

from neuronabox.topology import load_topology
from neuronabox.topology.graph import ClusterGraph

from .conftest import TOPOLOGIES, switch_topology, topo


def test_switch_graph_parts_and_route():
    g = ClusterGraph(switch_topology(4, ranks=2))
    assert len(g.vertices("host")) == 4 and len(g.vertices("rank")) == 8
    assert len(g.vertices("nic")) == 4 and g.switches == ["switch"]
    assert g.route_vertices(0, 1) == ["node0/r0", "node0", "node0/r1"]
    assert g.route_vertices(0, 2) == ["node0/r0", "node0/nic0", "switch", "node1/nic0", "node1/r0"]
    assert g.route_latency(0, 2) == pytest.approx(10e-6)  # two 5us links
    assert g.route_bandwidth(0, 2) == pytest.approx(12.5e9)
    assert g.route_latency(0, 1) == pytest.approx(1e-6)  # NVLink default
    assert g.route_bandwidth(0, 1) == pytest.approx(450e9)


def test_every_pair_is_reachable_along_its_route():
    for path in TOPOLOGIES.glob("*.yaml"):
        t = load_topology(path)
        g = ClusterGraph(t)
        n = t.world_size
        for src in range(0, n, max(1, n // 7)):
            for dst in range(0, n, max(1, n // 5)):
                verts = g.route_vertices(src, dst)
                assert verts[0] == g.rank_vertex[src] and verts[-1] == g.rank_vertex[dst]
                assert all(g.g.has_edge(u, v) for u, v in zip(verts, verts[1:]))
                assert len(set(verts)) == len(verts), "routes never loop"


def test_fat_tree_structure_and_oversubscription():
    t = topo(
        "cluster: {nodes: 16}\n"
        "network: {type: fat-tree, link: {bandwidth: 100Gbps, latency: 1us}, fat_tree: {k: 4, oversubscription: 4}}\n"
    )
    g = ClusterGraph(t)
    roles = [g.g.nodes[s]["role"] for s in g.switches]
    assert roles.count("edge") == 8 and roles.count("agg") == 8 and roles.count("core") == 4
    # Same edge switch: 2 links; same pod: 4; across pods: 6.
    assert len(g.route(0, 1)) == 4 and g.route_latency(0, 1) == pytest.approx(2e-6)
    assert g.route_latency(0, 2) == pytest.approx(4e-6)
    assert g.route_latency(0, 15) == pytest.approx(6e-6)
    # Edge uplinks carry a quarter of a host link.
    assert g.route_bandwidth(0, 1) == pytest.approx(12.5e9)
    assert g.route_bandwidth(0, 15) == pytest.approx(12.5e9 / 4)


def test_fat_tree_default_k_holds_the_cluster():
    g = ClusterGraph(topo("cluster: {nodes: 100}\nnetwork: {type: fat-tree, link: {bandwidth: 1Gbps}}\n"))
    cores = [s for s in g.switches if g.g.nodes[s]["role"] == "core"]
    assert len(cores) == (8 // 2) ** 2  # k=8 is the smallest k with k^3/4 >= 100


def test_ecmp_spreads_cross_pod_routes():
    t = topo("cluster: {nodes: 16}\nnetwork: {type: fat-tree, link: {bandwidth: 1Gbps}, fat_tree: {k: 4}}\n")
    g = ClusterGraph(t)
    cores = {v for s in range(4) for d in range(12, 16) for v in g.route_vertices(s, d) if v.startswith("core")}
    assert len(cores) > 1


def test_rail_optimized_same_rail_and_pxn():
    g = ClusterGraph(load_topology(TOPOLOGIES / "dgx-h100-32.yaml"))
    # Same local index: straight up the rail leaf.
    assert g.route_vertices(0, 8) == ["node0/r0", "node0/nic0", "rail0", "node1/nic0", "node1/r0"]
    # Another rail: NVLink to the NIC on the destination's rail first (PXN), never through a spine.
    verts = g.route_vertices(0, 9)
    assert verts[:3] == ["node0/r0", "node0", "node0/nic1"] and "rail1" in verts
    assert not any(v.startswith("spine") for v in verts)


def test_ring_takes_the_short_way_round():
    g = ClusterGraph(topo("cluster: {nodes: 8}\nnetwork: {type: ring, link: {bandwidth: 1Gbps, latency: 1us}}\n"))
    assert g.route_latency(0, 1) == pytest.approx(1e-6)
    assert g.route_latency(0, 7) == pytest.approx(1e-6)
    assert g.route_latency(0, 4) == pytest.approx(4e-6)
    two = ClusterGraph(topo("cluster: {nodes: 2}\nnetwork: {type: ring, link: {bandwidth: 1Gbps}}\n"))
    assert len(list(two.physical_links("net"))) == 1


def test_explicit_links_with_overrides():
    t = topo(
        "cluster: {nodes: 3}\n"
        "network:\n  type: links\n  link: {bandwidth: 10Gbps, latency: 1us}\n  switches: [s0]\n"
        "  links:\n    - {endpoints: [node0, s0]}\n    - {endpoints: [node1, s0], bandwidth: 1Gbps}\n"
        "    - {endpoints: [node2, node1], latency: 3us}\n"
    )
    g = ClusterGraph(t)
    assert g.route_vertices(0, 2) == ["node0/r0", "node0/nic0", "s0", "node1/nic0", "node2/nic0", "node2/r0"]
    assert g.route_bandwidth(0, 2) == pytest.approx(1e9 / 8)
    assert g.route_latency(0, 2) == pytest.approx(5e-6)


def test_whatif_scales_network_links():
    base = switch_topology(2)
    scaled = base.with_changes(whatif={"latency_scale": 2.0, "bandwidth_scale": 0.5})
    g0, g1 = ClusterGraph(base), ClusterGraph(scaled)
    assert g1.route_latency(0, 1) == pytest.approx(2 * g0.route_latency(0, 1))
    assert g1.route_bandwidth(0, 1) == pytest.approx(0.5 * g0.route_bandwidth(0, 1))


def test_switch_latency_is_added_per_switch_crossed():
    t = switch_topology(2, latency="1us").with_changes(network={"switch_latency": "500ns"})
    assert ClusterGraph(t).route_latency(0, 1) == pytest.approx(2.5e-6)


def test_dot_output_lists_every_link():
    g = ClusterGraph(switch_topology(3))
    dot = g.to_dot()
    assert dot.startswith('graph "test"') and dot.count(" -- ") == len(list(g.physical_links()))
    assert '"node2/nic0" -- "switch"' in dot or '"switch" -- "node2/nic0"' in dot


def test_gloo_links_carry_tcp_payload_only():
    gloo = ClusterGraph(switch_topology(2, extra="emulation: {library: gloo}\n"))
    assert gloo.route_bandwidth(0, 1) == pytest.approx(12.5e9 * 1448 / 1547)
    jumbo = switch_topology(2, extra="emulation: {library: gloo}\n").with_changes(network={"mtu": 9000})
    assert ClusterGraph(jumbo).route_bandwidth(0, 1) == pytest.approx(12.5e9 * 8948 / 9047)
    assert ClusterGraph(switch_topology(2)).route_bandwidth(0, 1) == pytest.approx(12.5e9)  # nccl: RDMA


def test_shaping_rate_stays_the_line_rate():
    g = ClusterGraph(switch_topology(2, extra="emulation: {library: gloo}\nwhatif: {bandwidth_scale: 0.5}\n"))
    arc = next(a for a in g.arcs if a.kind == "net")
    assert arc.rate == pytest.approx(12.5e9 * 0.5)
    assert arc.capacity == pytest.approx(12.5e9 * 0.5 * 1448 / 1547)
