"""The alpha-beta model against its closed forms, the nccl-tests factors, and monotonicity."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from neuronabox.collectives import NCCL_TESTS_NAME, Op, busbw_factor
from neuronabox.errors import InputError, TopologyError
from neuronabox.model.base import Group
from neuronabox.model.registry import create_model

from .conftest import switch_topology, topo

A = 10e-6  # two 5us links through the switch
B = 12.5e9  # 100 Gbps


def model(n=8, algorithm="ring", **kw):
    return create_model(switch_topology(n, **kw), "alpha-beta", algorithm=algorithm)


@pytest.mark.parametrize("n", [2, 3, 8, 64])
@pytest.mark.parametrize("S", [0, 1, 1 << 20, 1 << 30])
def test_ring_closed_forms(n, S):
    m = model(n)
    g = range(n)
    assert m.estimate(Op.ALL_REDUCE, S, g).duration == pytest.approx(2 * (n - 1) * A + 2 * (n - 1) / n * S / B)
    for op in (Op.ALL_GATHER, Op.REDUCE_SCATTER):
        assert m.estimate(op, S, g).duration == pytest.approx((n - 1) * A + (n - 1) / n * S / B)
    for op in (Op.BROADCAST, Op.REDUCE):
        assert m.estimate(op, S, g).duration == pytest.approx((n - 1) * A + S / B)


def test_other_closed_forms():
    n, S = 8, 1 << 24
    tree, rhd, direct = model(n, "tree"), model(n, "rhd"), model(n, "direct")
    assert tree.estimate(Op.ALL_REDUCE, S, range(n)).duration == pytest.approx(2 * 3 * A + 2 * S / B)
    assert tree.estimate(Op.BROADCAST, S, range(n)).duration == pytest.approx(3 * A + S / B)
    assert rhd.estimate(Op.ALL_REDUCE, S, range(n)).duration == pytest.approx(2 * 3 * A + 2 * 7 / 8 * S / B)
    assert rhd.estimate(Op.ALL_GATHER, S, range(n)).duration == pytest.approx(3 * A + 7 / 8 * S / B)
    assert direct.estimate(Op.ALL_TO_ALL, S, range(n)).duration == pytest.approx(A + 7 / 8 * S / B)
    # rhd on a non-power of two folds the extra ranks in and out: 2 more steps of the whole buffer
    r6 = model(6, "rhd").estimate(Op.ALL_REDUCE, S, range(6)).duration
    assert r6 == pytest.approx(2 * 2 * A + 2 * 3 / 4 * S / B + 2 * (A + S / B))
    assert model(n).estimate(Op.ALL_TO_ALL, S, range(n)).duration == pytest.approx(7 * (A + S / 8 / B))


def test_send_recv_and_barrier():
    m = model(8)
    assert m.estimate(Op.SEND_RECV, 1 << 20, [0, 5]).duration == pytest.approx(A + (1 << 20) / B)
    assert m.estimate(Op.BARRIER, 12345, range(8)).duration == pytest.approx(2 * 7 * A)
    assert model(8).estimate(Op.ALL_REDUCE, 1 << 20, [3]).duration == 0.0


def test_hierarchical_closed_form():
    # 4 nodes x 4 ranks, one NIC per node: the four local inter-node all-reduces share it.
    t = topo(
        "cluster: {nodes: 4, ranks_per_node: 4}\n"
        "intra_node: {fabric: nvlink, bandwidth: 100GB/s, latency: 1us}\n"
        "network: {type: switch, link: {bandwidth: 100Gbps, latency: 5us}}\n"
    )
    S, g, N = 1 << 26, 4, 4
    ai, bi, ax, bx = 1e-6, 100e9, 10e-6, 12.5e9 / 4
    intra = (g - 1) * ai + (g - 1) / g * S / bi
    inter = 2 * (N - 1) * ax + 2 * (N - 1) / N * (S / g) / bx
    est = create_model(t, "alpha-beta", algorithm="hier-ring").estimate(Op.ALL_REDUCE, S, range(16))
    assert est.algorithm == "hier-ring"
    assert est.duration == pytest.approx(2 * intra + inter)
    # flat ring: the ring leaves each node once through its single NIC
    flat = create_model(t, "alpha-beta", algorithm="ring").estimate(Op.ALL_REDUCE, S, range(16))
    assert flat.duration == pytest.approx(2 * 15 * ax + 2 * 15 / 16 * S / 12.5e9)


def test_multi_nic_ring_uses_parallel_channels():
    t = topo(
        "cluster: {nodes: 2, ranks_per_node: 8}\nintra_node: {bandwidth: 450GB/s}\n"
        "network: {type: rail-optimized, link: {bandwidth: 400Gbps, latency: 1us}}\n"
    )
    est = create_model(t, "alpha-beta", algorithm="ring").estimate(Op.ALL_REDUCE, 1 << 32, range(16))
    busbw = (1 << 32) / est.duration * busbw_factor(Op.ALL_REDUCE, 16)
    assert busbw == pytest.approx(8 * 50e9, rel=0.02)  # 8 rails of 50 GB/s


def test_forced_algorithm_without_the_op_falls_back_to_ring():
    est = model(8, "tree").estimate(Op.ALL_GATHER, 1 << 20, range(8))
    assert est.algorithm == "ring"
    hier_flat = model(8, "hier-tree").estimate(Op.ALL_REDUCE, 1 << 20, range(8))
    assert hier_flat.algorithm == "tree"  # one rank per node: nothing to do inside the nodes


def test_auto_picks_the_fastest_candidate():
    m = model(64, "auto")
    for S in (8, 1 << 12, 1 << 20, 1 << 28):
        est = m.estimate(Op.ALL_REDUCE, S, range(64))
        best = min(model(64, a).estimate(Op.ALL_REDUCE, S, range(64)).duration for a in ("ring", "tree"))
        assert est.duration == pytest.approx(best)
    assert m.estimate(Op.ALL_REDUCE, 8, range(64)).algorithm == "tree"
    assert m.estimate(Op.ALL_REDUCE, 1 << 30, range(64)).algorithm == "ring"


@pytest.mark.parametrize(
    "op, factor",
    [
        (Op.ALL_REDUCE, 2 * 7 / 8), (Op.ALL_GATHER, 7 / 8), (Op.REDUCE_SCATTER, 7 / 8), (Op.ALL_TO_ALL, 7 / 8),
        (Op.GATHER, 7 / 8), (Op.SCATTER, 7 / 8), (Op.BROADCAST, 1), (Op.REDUCE, 1), (Op.SEND_RECV, 1),
    ],
)
def test_nccl_tests_factors(op, factor):
    assert busbw_factor(op, 8) == pytest.approx(factor)
    assert op in NCCL_TESTS_NAME


def test_ring_busbw_approaches_link_bandwidth():
    m = model(16)
    S = 1 << 34
    t = m.estimate(Op.ALL_REDUCE, S, range(16)).duration
    assert S / t * busbw_factor(Op.ALL_REDUCE, 16) == pytest.approx(B, rel=1e-3)


ALGOS = ("ring", "tree", "rhd", "direct", "hier-ring", "hier-tree", "hier-rhd", "hier-direct")
MULTI_GLOO = topo(
    "cluster: {nodes: 6, ranks_per_node: 4}\nemulation: {library: gloo}\n"
    "network: {type: switch, link: {bandwidth: 25Gbps, latency: 2us}}\n"
)
MULTI = topo(
    "cluster: {nodes: 6, ranks_per_node: 4}\n"
    "network: {type: fat-tree, link: {bandwidth: 25Gbps, latency: 2us}, fat_tree: {oversubscription: 2}}\n"
)


@settings(max_examples=60, deadline=None)
@given(
    op=st.sampled_from(list(Op)),
    algo=st.sampled_from(ALGOS),
    s1=st.integers(0, 1 << 32),
    s2=st.integers(0, 1 << 32),
    n=st.integers(2, 24),
)
def test_monotonic_in_size(op, algo, s1, s2, n):
    m = create_model(MULTI, "alpha-beta", algorithm=algo)
    lo, hi = sorted((s1, s2))
    g = Group(range(n))
    t_lo, t_hi = m.estimate(op, lo, g).duration, m.estimate(op, hi, g).duration
    assert math.isfinite(t_hi) and t_lo >= 0
    assert t_lo <= t_hi * (1 + 1e-12)


@settings(max_examples=40, deadline=None)
@given(
    op=st.sampled_from(list(Op)),
    algo=st.sampled_from(ALGOS),
    size=st.integers(1, 1 << 30),
    scale=st.floats(1.01, 100.0),
)
def test_monotonic_in_bandwidth_and_latency(op, algo, size, scale):
    slow = create_model(MULTI, "alpha-beta", algorithm=algo)
    fast = create_model(MULTI.with_changes(whatif={"bandwidth_scale": scale}), "alpha-beta", algorithm=algo)
    near = create_model(MULTI.with_changes(whatif={"latency_scale": 1 / scale}), "alpha-beta", algorithm=algo)
    g = Group(range(24))
    base = slow.estimate(op, size, g).duration
    assert fast.estimate(op, size, g).duration <= base * (1 + 1e-12)
    assert near.estimate(op, size, g).duration <= base * (1 + 1e-12)


def test_every_op_and_algorithm_is_positive_and_has_a_schedule():
    for algo in ("auto",) + ALGOS:
        m = create_model(MULTI, "alpha-beta", algorithm=algo)
        for op in Op:
            est = m.estimate(op, 1 << 20, range(24))
            assert est.duration > 0 and math.isfinite(est.duration)
            steps = est.steps()
            assert steps and all(0 <= s.start <= s.end <= est.duration * (1 + 1e-9) for s in steps), (algo, op)
            assert all(s.src != s.dst for s in steps)


def test_auto_covers_every_op_for_both_libraries():
    for t in (MULTI, MULTI_GLOO):
        m = create_model(t, "alpha-beta", algorithm="auto")
        for op in Op:
            for size in (0, 8, 1 << 20, 1 << 30):
                assert m.estimate(op, size, range(24)).duration > 0


def test_ring_schedule_moves_the_right_bytes():
    n, S = 8, 1 << 20
    steps = model(n).estimate(Op.ALL_REDUCE, S, range(n)).steps()
    assert len(steps) == 2 * (n - 1) * n
    assert sum(s.nbytes for s in steps) == pytest.approx(2 * (n - 1) * S)
    assert {(s.src, s.dst) for s in steps} == {(i, (i + 1) % n) for i in range(n)}


def test_inject_adds_to_its_op_only():
    t = switch_topology(8, extra="whatif: {inject: {all_reduce: 2ms}}\n")
    m = create_model(t, "alpha-beta", algorithm="ring")
    plain = model(8)
    assert m.estimate(Op.ALL_REDUCE, 1024, range(8)).duration == pytest.approx(
        plain.estimate(Op.ALL_REDUCE, 1024, range(8)).duration + 2e-3
    )
    assert m.estimate(Op.ALL_GATHER, 1024, range(8)).duration == pytest.approx(
        plain.estimate(Op.ALL_GATHER, 1024, range(8)).duration
    )


def test_unknown_model_and_algorithm_errors():
    t = switch_topology(2, extra="emulation: {model: nope}\n")
    with pytest.raises(TopologyError, match=r"test.yaml: emulation.model: unknown model 'nope'"):
        create_model(t)
    t = switch_topology(2, extra="emulation: {algorithm: zigzag}\n")
    with pytest.raises(TopologyError, match=r"emulation.algorithm: 'zigzag' is not an algorithm"):
        create_model(t)
    with pytest.raises(InputError, match="--algorithm"):
        create_model(switch_topology(2), "alpha-beta", algorithm="zigzag")
