"""Large worlds (issue 31): structures proportional to nodes, not ranks; the same answers as an eager build.

A world above ``EAGER_MAX_RANKS`` builds a node only when a route needs it; these tests check
that the lazy build answers exactly as the eager one on small topologies (forced lazy), that a
10 M-rank world holds node-sized structures, and that ``nbox show`` on it is sane. No timings.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import yaml

from neuronabox.emu.group_table import GroupTable
from neuronabox.emu.straggler import compute_factors
from neuronabox.model.base import RANGE_FROM, Group
from neuronabox.model.registry import create_model
from neuronabox.topology import load_topology
from neuronabox.topology.graph import EAGER_MAX_RANKS, ClusterGraph
from neuronabox.topology.resolve import parse_topology, topology_from_dict

from .conftest import TOPOLOGIES, run_nbox

TEN_M = ("cluster: {nodes: 10000, ranks_per_node: 1000, device: H100}\n"
         "intra_node: {fabric: nvlink, bandwidth: 450GB/s, latency: 1us}\n"
         "network: {type: rail-optimized, nics_per_node: 8, link: {bandwidth: 400Gbps, latency: 1us}}\n"
         "emulation: {library: nccl, model: nccl, real_ranks: [0]}\n")


def _variants():
    """Every shipped topology, plus the cpu-8x1g cluster on each network type with three ranks a node."""
    out = {p.stem: yaml.safe_load(p.read_text()) for p in sorted(TOPOLOGIES.glob("*.yaml"))}
    for kind in ("switch", "ring", "fat-tree", "rail-optimized"):
        d = yaml.safe_load((TOPOLOGIES / "cpu-8x1g.yaml").read_text())
        d["network"]["type"] = kind
        d["cluster"]["ranks_per_node"] = 3
        d["cluster"]["overrides"] = {"2": {"compute_slowdown": 1.5}}
        out[f"cpu-8x3-{kind}"] = d
    return out


VARIANTS = _variants()


@pytest.mark.parametrize("name", list(VARIANTS))
def test_a_lazy_graph_routes_exactly_as_an_eager_one(name):
    topo = topology_from_dict(VARIANTS[name], f"{name}.yaml")
    eager, lazy = ClusterGraph(topo, lazy=False), ClusterGraph(topo, lazy=True)
    n = topo.world_size
    pairs = itertools.product(range(n), range(n)) if n <= 48 else ((a, b) for a in range(0, n, 7) for b in range(0, n, 5))
    for a, b in pairs:
        assert lazy.route_vertices(a, b) == eager.route_vertices(a, b), (a, b)
        assert lazy.route_latency(a, b) == eager.route_latency(a, b)
        assert lazy.route_bandwidth(a, b) == eager.route_bandwidth(a, b)
    assert lazy.network_link_count() == eager.network_link_count() == sum(1 for _ in eager.physical_links("net"))
    assert lazy.vertex_count() == eager.vertex_count() == eager.g.number_of_nodes()
    lazy.materialize()
    assert set(lazy.g.nodes) == set(eager.g.nodes) and set(lazy.g.edges) == set(eager.g.edges)
    assert len(lazy.capacity) == len(eager.capacity) == len(lazy.arcs)


@pytest.mark.parametrize("model", ["nccl", "alpha-beta", "flow"])
def test_models_estimate_the_same_on_a_lazy_graph(model):
    from neuronabox.collectives import Op

    topo = load_topology(TOPOLOGIES / "dgx-h100-32.yaml")
    eager = create_model(topo, model, graph=ClusterGraph(topo, lazy=False))
    lazy = create_model(topo, model, graph=ClusterGraph(topo, lazy=True))
    for group in (range(256), range(0, 256, 8), range(8, 24)):
        for op in (Op.ALL_REDUCE, Op.ALL_GATHER, Op.BROADCAST):
            assert lazy.estimate(op, 1 << 24, group).duration == eager.estimate(op, 1 << 24, group).duration


def test_a_small_world_is_built_eagerly_and_a_large_one_lazily():
    assert not ClusterGraph(load_topology(TOPOLOGIES / "dgx-h100-32.yaml")).lazy
    topo = parse_topology(TEN_M, "ten-m.yaml")
    assert topo.world_size == 10_000_000 > EAGER_MAX_RANKS and len(topo.nodes) == 10_000
    assert ClusterGraph(topo).lazy


def test_a_ten_million_rank_world_holds_node_sized_structures():
    topo = parse_topology(TEN_M, "ten-m.yaml")
    rn = topo.rank_node
    assert len(rn) == 10_000_000 and len(rn._firsts) == 10_000
    assert (rn[0], rn[999], rn[1000], rn[5_432_109], rn[-1]) == (0, 0, 1, 5432, 9999)
    assert topo.node_of(9_999_999).name == "node9999" and topo.local_rank(9_999_999) == 999
    with pytest.raises(IndexError):
        rn[10_000_000]
    g = ClusterGraph(topo)
    # Built at once: the 8 rail leaves and their spines, nothing per node.
    assert g.g.number_of_nodes() == len(g.switches) == 16 and len(g.arcs) == 2 * 8 * 8
    assert g.network_link_count() == 8 * 8 + 10_000 * 8
    assert g.vertex_count() == 16 + 10_000 * (1 + 8 + 1000)
    path = g.route_vertices(0, 9_999_999)
    assert path[0] == "node0/r0" and path[-1] == "node9999/r999" and "rail7" in path
    # Two nodes built for the route: host and 8 NICs each, and the route's two ranks.
    assert g.g.number_of_nodes() == 16 + 2 * (1 + 8) + 2
    assert len(g.capacity) == len(g.arcs) < 10_000
    assert g.rank_vertex[5_000_001] == "node5000/r1" and g.rank_nic[5_000_999] == "node5000/nic7"


def test_rank_nodes_read_like_the_tuple_they_replace():
    topo = load_topology(TOPOLOGIES / "hetero-a100-h100.yaml")
    expected = tuple(n.index for n in topo.nodes for _ in range(n.ranks))
    assert tuple(topo.rank_node) == expected and topo.rank_node == expected and len(topo.rank_node) == len(expected)
    assert [topo.rank_node[r] for r in range(len(expected))] == list(expected)
    assert topo.rank_node[2:5] == list(expected[2:5])
    assert topo == load_topology(TOPOLOGIES / "hetero-a100-h100.yaml")


def test_large_consecutive_groups_are_ranges_equal_to_their_tuples():
    n = RANGE_FROM + 3
    a, b = Group(range(n)), Group(tuple(range(n)))
    assert isinstance(a.ranks, range) and a == b and hash(a) == hash(b)
    assert isinstance(Group(range(8)).ranks, tuple)  # small groups stay as they were
    gap = tuple(r for r in range(n + 1) if r != 5)
    assert isinstance(Group(gap).ranks, tuple)
    table = GroupTable()
    table.start_world(10_000_000)
    assert table.groups[0] == range(10_000_000) and table.containing(9_999_999) == [0]


def test_slow_nodes_are_held_per_node_and_read_like_a_dict():
    d = VARIANTS["cpu-8x3-switch"]
    d = {**d, "whatif": {"stragglers": {1: 2.0, 7: 3.0}}}
    topo = topology_from_dict(d, "slow.yaml")
    got = compute_factors(topo, 0)
    expected = {1: 2.0, 6: 1.5, 7: 4.5, 8: 1.5}  # node 2 (ranks 6-8) is 1.5 times slower
    assert dict(got) == expected and got == expected and len(got) == 4 and bool(got)
    assert got.get(7) == 4.5 and got.get(0, 1.0) == 1.0 and 6 in got and 0 not in got
    assert got.pop(6, None) == 1.5 and 6 not in got and got.pop(6, None) is None
    assert not compute_factors(topology_from_dict(VARIANTS["cpu-8x1g"], "even.yaml"), 0)
    big = compute_factors(parse_topology(TEN_M, "ten-m.yaml"), 0)
    assert not big and big.get(9_999_999) is None


def test_show_on_a_ten_million_rank_world_is_sane(tmp_path):
    path = tmp_path / "ten-m.yaml"
    path.write_text(TEN_M)
    r = run_nbox("show", str(path), "--route", "0:9999999")
    assert r.returncode == 0, r.stderr
    assert "10000000 ranks on 10000 nodes" in r.stdout
    assert "80064 network links, 16 switches" in r.stdout
    assert "node9999/nic7" in r.stdout and "total latency" in r.stdout
    r = run_nbox("show", str(path), "--dot", str(tmp_path / "g.dot"))
    lines = (r.stdout + r.stderr).strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and "--dot" in lines[0] and "too large to draw" in lines[0]
    assert not (tmp_path / "g.dot").exists()


def test_a_what_if_world_of_ten_million_ranks_is_shown(tmp_path):
    path = tmp_path / "two.yaml"
    path.write_text("cluster: {nodes: 2, ranks_per_node: 1000}\n"
                    "network: {type: switch, link: {bandwidth: 100Gbps, latency: 5us}}\n")
    r = run_nbox("show", str(path), "--world-size", "10000000")
    assert r.returncode == 0, r.stderr
    assert "10000000 ranks on 10000 nodes" in r.stdout and "10000 network links, 1 switches" in r.stdout


def test_deep_block_yaml_is_refused_with_one_line(tmp_path):
    path = tmp_path / "deep.yaml"
    path.write_text("cluster:\n" + "".join("  " * i + "a:\n" for i in range(1, 60)) + "  " * 60 + "b: 1\n")
    r = run_nbox("show", str(path))
    lines = (r.stdout + r.stderr).strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and "nested deeper than 32" in lines[0], lines


def test_neighbour_nodes_follow_the_ring_in_rank_order():
    from neuronabox.cluster.stub import neighbour_nodes

    topo = load_topology(TOPOLOGIES / "hetero-a100-h100.yaml")
    order = sorted(range(topo.world_size), key=lambda r: (topo.rank_node[r], r))  # the ring, spelled out
    for r in (0, 5, topo.world_size - 1):
        i = order.index(r)
        want = list(dict.fromkeys(topo.node_of(x).name for x in (order[i - 1], order[(i + 1) % len(order)])))
        assert neighbour_nodes(topo, [r]) == want
    assert neighbour_nodes(parse_topology(TEN_M, "ten-m.yaml")) == ["node9999", "node0"]


@pytest.mark.parametrize("name", ["dgx-h100-32", "cpu-8x3-fat-tree", "cpu-8x3-ring"])
def test_up_plans_the_same_network_from_a_lazy_graph(name, monkeypatch):
    from neuronabox.cluster.netplan import plan_network
    from neuronabox.topology import graph

    topo = topology_from_dict(VARIANTS[name], f"{name}.yaml")
    eager = plan_network(topo, "t")
    monkeypatch.setattr(graph, "EAGER_MAX_RANKS", 0)
    assert ClusterGraph(topo).lazy
    assert plan_network(topo, "t") == eager


@pytest.mark.parametrize("model", ["nccl", "alpha-beta"])
def test_a_group_held_as_a_range_is_timed_as_its_tuple(model, monkeypatch):
    from neuronabox.collectives import Op
    from neuronabox.model import base

    topo = load_topology(TOPOLOGIES / "dgx-h100-32.yaml")
    groups = (range(256), range(3, 250), range(8, 16))
    ops = (Op.ALL_REDUCE, Op.ALL_GATHER, Op.REDUCE_SCATTER, Op.BROADCAST, Op.ALL_TO_ALL, Op.SEND_RECV)

    def answers():
        m = create_model(topo, model)
        assert all(isinstance(Group(g).ranks, range) for g in groups) == (base.RANGE_FROM <= 8)
        return [(e.duration, e.algorithm, e.protocol, len(e.steps()))
                for g in groups for op in ops for size in (1 << 12, 1 << 26) for e in [m.estimate(op, size, g, 1)]]

    as_tuples = answers()
    monkeypatch.setattr(base, "RANGE_FROM", 4)
    assert answers() == as_tuples


@pytest.mark.parametrize("model", ["nccl", "alpha-beta"])
def test_the_first_all_reduce_of_a_ten_million_rank_world_builds_node_sized_tables(model):
    from neuronabox.collectives import Op

    topo = parse_topology(TEN_M, "ten-m.yaml")
    m = create_model(topo, model)
    est = m.estimate(Op.ALL_REDUCE, 1 << 26, m.world())
    assert est.duration > 0 and isinstance(m.world().ranks, range)
    # Hosts and NICs of every node, a rank a NIC and a few more: nowhere near a vertex per rank.
    assert m.graph.g.number_of_nodes() <= 16 + 10_000 * (1 + 8 + 8 + 3)


def test_the_slowest_of_a_range_is_read_per_node():
    d = {**VARIANTS["cpu-8x3-switch"], "whatif": {"stragglers": {1: 2.0, 7: 3.0, 12: 0.5}}}
    topo = topology_from_dict(d, "slow.yaml")
    got = compute_factors(topo, 0)
    for lo in range(topo.world_size):
        for hi in range(lo + 1, topo.world_size + 1):
            assert got.largest(range(lo, hi)) == max((got.get(r, 1.0) for r in range(lo, hi)), default=1.0), (lo, hi)
    big = compute_factors(parse_topology(TEN_M, "ten-m.yaml"), 0)
    assert big.largest(range(10_000_000)) == 1.0


@pytest.mark.parametrize("runtime", ["netns", "docker"])
def test_up_refuses_more_nodes_than_a_cluster_holds_in_one_line(runtime, tmp_path):
    from neuronabox.cluster.netplan import MAX_CLUSTER_NODES

    path = tmp_path / "ten-m.yaml"
    path.write_text(TEN_M)
    r = run_nbox("up", str(path), "--runtime", runtime, "--name", "lwtoobig")
    lines = (r.stdout + r.stderr).strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, lines
    assert str(path) in lines[0] and "10000 nodes" in lines[0] and str(MAX_CLUSTER_NODES) in lines[0]
    assert not list(tmp_path.glob("*.json")) and not (Path("/run/neuronabox") / "lwtoobig").exists()
