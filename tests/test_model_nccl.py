"""The nccl delay model: NCCL's tuning formulas, selection, schedules and errors."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from neuronabox.collectives import Op, busbw_factor
from neuronabox.errors import TopologyError
from neuronabox.model import nccl
from neuronabox.model.base import Group
from neuronabox.model.registry import create_model
from neuronabox.topology import parse_topology

H100 = """
cluster: {{nodes: {nodes}, ranks_per_node: {rpn}, device: H100}}
intra_node: {{fabric: nvlink, bandwidth: 450GB/s, latency: 1us}}
network: {{type: rail-optimized, link: {{bandwidth: 400Gbps, latency: 2us}}}}
emulation: {{model: nccl, algorithm: {algo}, protocol: {proto}, nccl_version: "{version}", hardware: none}}
"""


def topo(nodes=1, rpn=8, algo="auto", proto="auto", version="2.28"):
    return parse_topology(H100.format(nodes=nodes, rpn=rpn, algo=algo, proto=proto, version=version), "t.yaml")


@pytest.fixture(scope="module")
def single():
    return create_model(topo(), "nccl")


@pytest.fixture(scope="module")
def multi():
    return create_model(topo(nodes=4), "nccl")


def test_ring_simple_all_reduce_matches_hand_computed_formula():
    model = create_model(topo(), "nccl", algorithm="ring", protocol="Simple")
    size = 1 << 30
    est = model.estimate(Op.ALL_REDUCE, size, range(8))
    # Channel search on sm90: 450 GB/s // 60 = 7 channels at 60 GB/s, duplicated to 14 at 30.
    bus_bw = 14 * 30.0
    alg_bw = bus_bw * 8 / (2 * 7)  # ring ratio nRanks / nsteps
    # baseLat ring/Simple 8.4 us + nsteps (14) x NVLink ring/Simple hwLat 3.4 us; single node, no inter steps.
    latency = 8.4 + 14 * 3.4
    assert (est.algorithm, est.protocol) == ("ring", "Simple")
    assert est.duration == pytest.approx((latency + size / (1000 * alg_bw)) * 1e-6, rel=1e-9)


def test_tree_ll_multi_node_latency_matches_formula():
    model = create_model(topo(nodes=4), "nccl", algorithm="tree", protocol="LL")
    graph = model.graph
    lat_inter_us = (graph.route_latency(0, 8) + graph.route_latency(8, 16) + graph.route_latency(16, 24)
                    + graph.route_latency(24, 0)) / 4 * 1e6
    est = model.estimate(Op.ALL_REDUCE, 4, range(32))  # one float: the latency alone (NCCL drops a count of 0)
    # baseLat 6.8 + 2 * ((32/4 - 1) * NVLink tree/LL 0.6 + log2(4) * (NET tree/LL 5.0 + latencyInter)).
    expected = 6.8 + 2 * (7 * 0.6 + 2 * (5.0 + lat_inter_us))
    assert est.duration == pytest.approx(expected * 1e-6, rel=1e-4)  # 4 B at LL speed: 1e-5 of it


def _forced(topology, op, nbytes, ranks):
    out = {}
    for algo in nccl.NcclModel.algorithms:
        for proto in nccl.NcclModel.protocols:
            est = create_model(topology, "nccl", algorithm=algo, protocol=proto).estimate(op, nbytes, ranks)
            if (est.algorithm, est.protocol) == (algo, proto):  # not a fallback
                out[(algo, proto)] = est.duration
    return out


@pytest.mark.parametrize("nodes", [1, 4])
@pytest.mark.parametrize("op", [Op.ALL_REDUCE, Op.ALL_GATHER, Op.REDUCE_SCATTER, Op.BROADCAST])
@pytest.mark.parametrize("nbytes", [8, 1 << 16, 1 << 22, 1 << 30])
def test_auto_is_the_minimum_over_enumerated_candidates(nodes, op, nbytes):
    t = topo(nodes=nodes)
    ranks = range(8 * nodes)
    candidates = _forced(t, op, nbytes, ranks)
    auto = create_model(t, "nccl").estimate(op, nbytes, ranks)
    best = min(candidates, key=candidates.get)
    assert auto.duration == pytest.approx(candidates[best], rel=1e-12)
    assert (auto.algorithm, auto.protocol) == best


def test_ll_for_tiny_messages_simple_or_ll128_for_large(single, multi):
    for model, n in ((single, 8), (multi, 32)):
        assert model.estimate(Op.ALL_REDUCE, 8, range(n)).protocol == "LL"
        assert model.estimate(Op.ALL_REDUCE, 1 << 30, range(n)).protocol in ("Simple", "LL128")


def test_large_ring_bus_bandwidth_approaches_per_rank_bandwidth():
    model = create_model(topo(), "nccl", algorithm="ring", protocol="Simple")
    size = 16 << 30
    est = model.estimate(Op.ALL_REDUCE, size, range(8))
    busbw = size / est.duration * busbw_factor(Op.ALL_REDUCE, 8)
    # NCCL's search fits 14 x 30 GB/s channels under the 450 GB/s per-rank NVLink bandwidth.
    assert 0.9 * 450e9 <= busbw <= 450e9
    assert busbw == pytest.approx(420e9, rel=1e-3)


@settings(max_examples=200, deadline=None)
@given(
    a=st.integers(min_value=0, max_value=1 << 34),
    b=st.integers(min_value=0, max_value=1 << 34),
    op=st.sampled_from([Op.ALL_REDUCE, Op.ALL_GATHER, Op.REDUCE_SCATTER, Op.BROADCAST, Op.REDUCE, Op.ALL_TO_ALL,
                        Op.GATHER, Op.SCATTER, Op.SEND_RECV]),
    nodes=st.sampled_from([1, 4]),
)
def test_duration_is_monotonic_in_bytes(a, b, op, nodes):
    model = _MODELS[nodes]
    lo, hi = sorted((a, b))
    ranks = range(8 * nodes)
    assert model.estimate(op, lo, ranks).duration <= model.estimate(op, hi, ranks).duration


_MODELS = {1: create_model(topo(), "nccl"), 4: create_model(topo(nodes=4), "nccl")}


def test_forcing_algorithm_and_protocol(single):
    forced = create_model(topo(algo="tree", proto="LL128"), "nccl")
    est = forced.estimate(Op.ALL_REDUCE, 1 << 20, range(8))
    assert (est.algorithm, est.protocol) == ("tree", "LL128")
    only_simple = create_model(topo(proto="Simple"), "nccl")
    assert only_simple.estimate(Op.ALL_REDUCE, 8, range(8)).protocol == "Simple"
    # Tree has no all-gather in NCCL: ring stays available as the backup.
    assert forced.estimate(Op.ALL_GATHER, 1 << 20, range(8)).algorithm == "ring"


def test_unsupported_algorithm_names_emulation_algorithm():
    with pytest.raises(TopologyError) as err:
        create_model(topo(algo="collnet_direct"), "nccl")
    assert err.value.path == "emulation.algorithm"


def test_nccl_algo_and_proto_lists_enable_what_they_name():
    # GCP's TCPXO profile: NCCL_ALGO=Ring,Tree NCCL_PROTO=Simple (and NCCL_NVLS_ENABLE=0, which the list implies).
    gcp = create_model(topo(nodes=2, algo='"Ring,Tree"', proto="Simple"), "nccl")
    assert (gcp.algorithm, gcp.protocol) == ("ring,tree", "Simple")
    picks = {(e.algorithm, e.protocol) for k in range(3, 34, 2) for op in (Op.ALL_REDUCE, Op.ALL_GATHER, Op.BROADCAST)
             for e in [gcp.estimate(op, 1 << k, range(16))]}
    assert {a for a, _ in picks} == {"ring", "tree"} and {p for _, p in picks} == {"Simple"}
    free = create_model(topo(nodes=2), "nccl")
    assert free.estimate(Op.ALL_REDUCE, 1 << 32, range(16)).algorithm == "nvls_tree"
    assert free.estimate(Op.ALL_REDUCE, 1 << 10, range(16)).protocol == "LL"
    # A leading ^ excludes: no NVLS on one node, and LL128 stays at NCCL's default (on, over NVLink).
    no_nvls = create_model(topo(algo='"^nvls,NVLSTree"', proto='"^LL"'), "nccl")
    assert no_nvls.algorithm == "^nvls,nvls_tree"
    est = no_nvls.estimate(Op.ALL_REDUCE, 1 << 30, range(8))
    assert est.algorithm == "ring" and create_model(topo(), "nccl").estimate(Op.ALL_REDUCE, 1 << 30, range(8)).algorithm == "nvls"
    assert {no_nvls.estimate(Op.ALL_REDUCE, 1 << k, range(8)).protocol for k in range(3, 31)} <= {"LL128", "Simple"}


@pytest.mark.parametrize("algo,proto,field,needle", [
    ('"ring,trie"', "auto", "emulation.algorithm", "'trie' in 'ring,trie' is not an algorithm"),
    ("auto", '"Simple,LL256"', "emulation.protocol", "'LL256' is not a protocol"),  # refused as the file loads
    ('"^ring,tree,nvls,nvls_tree,pat"', "auto", "emulation.algorithm", "leaves no algorithm"),
])
def test_bad_nccl_lists_name_the_field(algo, proto, field, needle):
    with pytest.raises(TopologyError, match=needle) as err:
        create_model(topo(algo=algo, proto=proto), "nccl")
    assert err.value.path == field


def test_unknown_nccl_version_names_emulation_nccl_version():
    with pytest.raises(TopologyError) as err:
        create_model(topo(version="2.3"), "nccl")
    assert err.value.path == "emulation.nccl_version"
    assert "2.28" in err.value.detail


def test_nccl_patch_release_uses_its_minor_constants():
    assert create_model(topo(version="2.28.9"), "nccl").release == "2.28"


@pytest.mark.parametrize("op", list(Op))
@pytest.mark.parametrize("nodes,ranks", [(1, range(8)), (1, [0, 3]), (4, range(32)), (4, [0, 8, 16, 24])])
def test_every_op_has_positive_finite_duration(op, nodes, ranks):
    model = _MODELS[nodes]
    est = model.estimate(op, 1 << 20, ranks)
    assert 0 < est.duration < math.inf
    assert est.steps(), "every multi-rank collective has a schedule"


def test_single_rank_group_is_free(single):
    est = single.estimate(Op.ALL_REDUCE, 1 << 30, [3])
    assert est.duration == 0.0 and est.steps() == []


def test_nvls_only_on_single_node_hopper_nvlink(single, multi):
    assert single.estimate(Op.ALL_REDUCE, 1 << 30, range(8)).algorithm == "nvls"
    assert multi.estimate(Op.ALL_REDUCE, 1 << 30, range(32)).algorithm != "nvls"
    text = H100.format(nodes=1, rpn=8, algo="auto", proto="auto", version="2.28")
    a100 = parse_topology(text.replace("H100", "A100"))
    assert create_model(a100, "nccl").estimate(Op.ALL_REDUCE, 1 << 30, range(8)).algorithm != "nvls"


def test_pat_for_one_rank_per_node():
    model = create_model(topo(nodes=16, rpn=1), "nccl")
    assert model.estimate(Op.ALL_GATHER, 1 << 16, range(16)).algorithm == "pat"


def test_latency_whatif_changes_inter_node_estimates(multi):
    slow = create_model(topo(nodes=4).with_changes(whatif={"latency_scale": 10}), "nccl")
    for op in (Op.ALL_REDUCE, Op.ALL_GATHER, Op.BROADCAST, Op.ALL_TO_ALL):
        assert slow.estimate(op, 8, range(32)).duration > multi.estimate(op, 8, range(32)).duration


def test_ring_all_reduce_schedule():
    model = create_model(topo(), "nccl", algorithm="ring", protocol="Simple")
    n, size = 8, 1 << 24
    est = model.estimate(Op.ALL_REDUCE, size, range(n))
    steps = est.steps()
    assert len(steps) == 2 * (n - 1) * n
    assert sum(s.nbytes for s in steps) == pytest.approx(2 * (n - 1) * size)
    assert max(s.end for s in steps) == pytest.approx(est.duration)
    assert all(s.dst == (s.src + 1) % n for s in steps)


def test_repeated_estimates_come_from_the_groups_cached_tables(multi, monkeypatch):
    # How many a second is a benchmark's figure (benchmarks/model_speed.py, `make bench`), not a test's.
    group = Group(range(32))
    first = multi.estimate(Op.ALL_REDUCE, 1 << 20, group)

    def derived_again(*args):
        raise AssertionError("the group's tables were derived again")

    monkeypatch.setattr(multi, "_derive", derived_again)
    assert all(multi.estimate(Op.ALL_REDUCE, 1 << 20, group).duration == first.duration for _ in range(1000))


def test_ll128_off_over_pcie_unless_named_in_nccl_proto():
    pcie = H100.replace("fabric: nvlink, bandwidth: 450GB/s", "fabric: pcie, bandwidth: 32GB/s")
    auto = create_model(parse_topology(pcie.format(nodes=1, rpn=4, algo="auto", proto="auto", version="2.28"), "t.yaml"),
                        "nccl")
    assert all(auto.estimate(Op.ALL_REDUCE, 1 << k, range(4)).protocol != "LL128" for k in range(3, 31, 3))
    # NCCL_PROTO=LL128 turns it on even where the default leaves it off (nccl-tests of a PCIe L40S node ran it).
    named = create_model(parse_topology(pcie.format(nodes=1, rpn=4, algo="auto", proto="LL128", version="2.28"),
                                        "t.yaml"), "nccl")
    est = named.estimate(Op.ALL_REDUCE, 1 << 24, range(4))
    assert (est.algorithm, est.protocol) == ("ring", "LL128")


EFA = """
cluster: {{nodes: {nodes}, ranks_per_node: 8, device: {device}}}
intra_node: {{fabric: nvlink, bandwidth: 450GB/s, latency: 1us}}
network: {{type: switch, fabric: {fabric}, nics_per_node: 32, link: {{bandwidth: 100Gbps, latency: 10us}}}}
emulation: {{model: nccl, nccl_version: "2.28", hardware: none, nccl_tuner: {tuner}, protocol: {proto}}}
"""


def efa_topo(nodes=4, device="H100", fabric="efa", tuner="auto", proto="auto"):
    text = EFA.format(nodes=nodes, device=device, fabric=fabric, tuner=tuner, proto=proto)
    return parse_topology(text, "t.yaml")


@pytest.mark.parametrize(("ranks", "nbytes", "expected"), [
    (32, 16 << 20, ("tree", "LL128")),  # below the 36 MiB vertex at 32 ranks
    (32, 128 << 20, ("ring", "LL128")),
    (32, 4 << 30, ("ring", "Simple")),
    (64, 64 << 20, ("tree", "LL128")),
    (128, 256 << 20, ("tree", "LL128")),
    (128, 4 << 30, ("nvls_tree", "Simple")),
    (256, 512 << 20, ("nvls_tree", "Simple")),
    (64, 2 << 30, ("ring", "LL128")),  # on a vertex of ring/LL128: an edge counts as inside
])
def test_aws_ofi_tuner_regions_for_p5(ranks, nbytes, expected):
    from neuronabox.model import aws_ofi_tuner

    every = {(a, p) for a in range(len(nccl.ALGO_NAMES)) for p in range(3)}
    algo, proto = aws_ofi_tuner.choose("all_reduce", nbytes, ranks, every)
    assert (nccl.ALGO_NAMES[algo], nccl.PROTO_NAMES[proto]) == expected
    # A pair NCCL left disabled is skipped, as the plugin skips an ignored cost-table entry.
    assert aws_ofi_tuner.choose("all_reduce", nbytes, ranks, every - {(algo, proto)}) != (algo, proto)


def test_aws_ofi_tuner_applies_to_p5_layouts_above_two_nodes_only():
    from neuronabox.model import aws_ofi_tuner

    assert aws_ofi_tuner.applies("H100", 32, 4)
    assert aws_ofi_tuner.applies("H200", 256, 32)
    assert not aws_ofi_tuner.applies("H100", 16, 2)  # the plugin falls back to NCCL at <= 2 nodes
    assert not aws_ofi_tuner.applies("A100", 32, 4)  # p4d: no region tuner
    assert not aws_ofi_tuner.applies("H100", 16, 4)  # 4 ranks a node: not the 8-a-node table
    assert aws_ofi_tuner.choose("all_gather", 1 << 30, 32, {(1, 2)}) is None


def _argmin(model, op, nbytes, n):
    tables = model.group_tables(Group.of(range(n)))
    func = nccl._FUNC_OF_OP[op]
    best = min(tables.candidates[func], key=lambda c: model._algo_time(tables, func, c, nbytes))
    return nccl.ALGO_NAMES[best.algo], nccl.PROTO_NAMES[best.proto]


def test_efa_p5_all_reduce_takes_the_aws_tuners_pick():
    model = create_model(efa_topo(nodes=4), "nccl")
    for nbytes, expected in ((16 << 20, ("tree", "LL128")), (128 << 20, ("ring", "LL128")),
                             (4 << 30, ("ring", "Simple"))):
        est = model.estimate(Op.ALL_REDUCE, nbytes, range(32))
        assert (est.algorithm, est.protocol) == expected
    # The plugin has no p5 all-gather regions at 8 ranks a node: NCCL's own pick.
    est = model.estimate(Op.ALL_GATHER, 1 << 30, range(32))
    assert (est.algorithm, est.protocol) == _argmin(model, Op.ALL_GATHER, 1 << 30, 32)


@pytest.mark.parametrize("kwargs", [
    {"nodes": 4, "tuner": "nccl"},  # turned off in the topology
    {"nodes": 4, "fabric": "ib"},  # auto: only on EFA
    {"nodes": 2},  # the plugin's own fallback at two nodes
])
def test_nccls_own_pick_where_the_aws_tuner_does_not_run(kwargs):
    model = create_model(efa_topo(**kwargs), "nccl")
    n = 8 * kwargs["nodes"]
    for nbytes in (16 << 20, 128 << 20, 4 << 30):
        est = model.estimate(Op.ALL_REDUCE, nbytes, range(n))
        assert (est.algorithm, est.protocol) == _argmin(model, Op.ALL_REDUCE, nbytes, n)


def test_aws_tuner_forced_on_another_fabric_and_respects_nccl_proto():
    model = create_model(efa_topo(nodes=4, fabric="ib", tuner="aws-ofi"), "nccl")
    est = model.estimate(Op.ALL_REDUCE, 128 << 20, range(32))
    assert (est.algorithm, est.protocol) == ("ring", "LL128")
    # NCCL_PROTO=Simple leaves LL128 ignored in the cost table: the plugin's LL128 regions are skipped.
    model = create_model(efa_topo(nodes=4, proto="Simple"), "nccl")
    assert model.estimate(Op.ALL_REDUCE, 128 << 20, range(32)).protocol == "Simple"


def _channels_topo(extra: str, algo: str = "auto"):
    text = H100.format(nodes=2, rpn=8, algo=algo, proto="auto", version="2.28").replace(
        "hardware: none}", "hardware: h100-ib" + extra + "}")
    return parse_topology(text, "t.yaml")


def test_min_and_max_channels_change_the_time_not_the_algorithm():
    """NCCL_MIN_CTAS / NCCL_MAX_CTAS: the communicator runs on more or fewer channels, and each channel moves at most channel_GBps."""
    default = create_model(_channels_topo(""), "nccl")
    more = create_model(_channels_topo(", min_channels: 24"), "nccl")
    fewer = create_model(_channels_topo(", max_channels: 2"), "nccl")
    group = list(range(16))
    for nbytes in (1 << 16, 1 << 20, 1 << 24, 1 << 30):
        d, m, f = (x.estimate(Op.ALL_REDUCE, nbytes, group) for x in (default, more, fewer))
        assert d.algorithm == m.algorithm  # tuning reads the searched graph (only ring's plateau reads the channels)
        assert m.duration <= d.duration <= f.duration
    tables = {x: next(iter(x._tables.values())).n_channels for x in (default, more, fewer)}
    assert tables[default] == 16 and tables[more] == 24 and tables[fewer] == 2
    # a ring on two channels cannot fill the NICs: large sizes take longer (small ones used few channels anyway)
    ring, ring2 = (create_model(_channels_topo(e, algo="ring"), "nccl") for e in ("", ", max_channels: 2"))
    for nbytes in (1 << 24, 1 << 30):
        assert ring2.estimate(Op.ALL_REDUCE, nbytes, group).duration > ring.estimate(Op.ALL_REDUCE, nbytes, group).duration


def test_min_channels_above_max_channels_is_refused():
    with pytest.raises(TopologyError) as err:
        _channels_topo(", min_channels: 24, max_channels: 8")
    assert "min_channels 24 is above max_channels 8" in str(err.value)
    with pytest.raises(TopologyError) as err:
        _channels_topo(", min_channels: 0")
    assert "min_channels" in str(err.value)
