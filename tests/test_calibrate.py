"""The calibration fit, the profile file and the calibrated model, on synthetic measurements (no cluster, no root)."""

from __future__ import annotations

import json
import math
import random

import pytest

from neuronabox.collectives import Op
from neuronabox.errors import InputError
from neuronabox.fidelity.calibrate import _read_measured, _time_limit, _topup, default_sizes, parse_ops, parse_precision, parse_size_range
from neuronabox.fidelity.fit import fit_piecewise, link_estimate
from neuronabox.fidelity.measure import cpu_cost_rows
from neuronabox.fidelity.profile import make_profile, save_profile
from neuronabox.model.profile import load_profile, ring_terms
from neuronabox.model.registry import create_model

from .conftest import topo

TWO = topo("name: two\ncluster: {nodes: 2}\nnetwork: {type: ring, link: {bandwidth: 1Gbps, latency: 100us}}\n"
           "emulation: {library: gloo}\n")
EIGHT = topo("name: eight\ncluster: {nodes: 8, ranks_per_node: 2}\nnetwork: {type: ring, link: {bandwidth: 1Gbps, latency: 100us}}\n"
             "emulation: {library: gloo}\n")


def two_regimes(noise: float = 0.003, seed: int = 1):
    """A library that switches from a low-latency to a high-bandwidth algorithm (t = the faster one), 4 B to 256 MiB."""
    rng = random.Random(seed)
    sizes = default_sizes(4, 256 << 20)
    # all-reduce over n=2 ranks: t = 2 alpha + S / B (L = 2, F = 1)
    a1, b1, a2, b2 = 25e-6, 1e9, 250e-6, 5e9
    times = [min(2 * a1 + s / b1, 2 * a2 + s / b2) * (1 + rng.gauss(0, noise)) for s in sizes]
    cross = (2 * a2 - 2 * a1) / (1 / b1 - 1 / b2)
    return sizes, times, (a1, b1, a2, b2, cross)


def close(x, y, rel):
    return abs(x - y) <= rel * abs(y)


def test_fit_recovers_alpha_bandwidth_and_breakpoint_within_2_percent():
    sizes, times, (a1, b1, a2, b2, cross) = two_regimes()
    fit = fit_piecewise(sizes, times, Op.ALL_REDUCE, n=2)
    assert len(fit.segments) == 2
    s1, s2 = fit.segments
    assert close(s1.alpha_s, a1, 0.02) and close(s1.bandwidth_Bps, b1, 0.02)
    assert close(s2.alpha_s, a2, 0.02) and close(s2.bandwidth_Bps, b2, 0.02)
    assert close(fit.breakpoints[0], cross, 0.02)
    assert fit.rms_rel_error < 0.01


def test_fit_of_one_regime_stays_one_segment_and_finds_a_jump():
    sizes = default_sizes(4, 16 << 20)
    line = [100e-6 + s / 2e9 for s in sizes]
    fit = fit_piecewise(sizes, line, Op.BROADCAST, n=2)
    assert len(fit.segments) == 1
    assert close(fit.segments[0].alpha_s, 100e-6, 1e-6) and close(fit.segments[0].bandwidth_Bps, 2e9, 1e-6)
    # A protocol switch: the time jumps by 300 us above 64 KiB; the breakpoint sits in the gap.
    jump = [t + (300e-6 if s > 64 << 10 else 0.0) for s, t in zip(sizes, line)]
    fit = fit_piecewise(sizes, jump, Op.BROADCAST, n=2)
    assert len(fit.segments) == 2
    assert 64 << 10 <= fit.breakpoints[0] <= 128 << 10
    assert fit.rms_rel_error < 1e-3


def test_a_disturbed_size_is_left_out_of_the_fit():
    sizes, times, (a1, b1, a2, b2, cross) = two_regimes(noise=0.01, seed=3)
    disturbed = list(times)
    k = sizes.index(4096)
    disturbed[k] *= 5  # a neighbour's test stole the core for this size
    fit = fit_piecewise(sizes, disturbed, Op.ALL_REDUCE, n=2)
    assert fit.outliers == [4096]
    assert close(fit.segments[0].alpha_s, a1, 0.03)


def test_ring_terms_match_the_closed_forms():
    assert ring_terms(Op.ALL_REDUCE, 8) == (14.0, 14 / 8)
    assert ring_terms(Op.ALL_GATHER, 4) == (3.0, 0.75)
    assert ring_terms(Op.BROADCAST, 4) == (3.0, 1.0)
    assert ring_terms(Op.BARRIER, 4) == (6.0, 0.0)
    assert ring_terms(Op.ALL_REDUCE, 1) == (0.0, 0.0)


def test_sizes_ops_and_their_errors():
    assert parse_size_range("4B:256MiB") == (4, 256 << 20)
    sizes = default_sizes(4, 256 << 20)
    assert sizes[0] == 4 and sizes[-1] == 256 << 20 and len(sizes) == 27
    assert default_sizes(4, 100) == [4, 8, 16, 32, 64, 100]
    assert parse_ops("all")[0] is Op.ALL_REDUCE and Op.BARRIER in parse_ops("all")
    assert parse_ops("allreduce,broadcast") == [Op.ALL_REDUCE, Op.BROADCAST]
    for bad in ("8MiB:4B", "x:1MiB"):
        with pytest.raises(InputError, match="--sizes"):
            parse_size_range(bad)
    with pytest.raises(InputError, match="--ops"):
        parse_ops("all_reduce,frobnicate")


def test_precision_sets_the_top_up_rounds_and_off_has_none():
    assert parse_precision("2%") == pytest.approx(0.02) and parse_precision("0.05") == pytest.approx(0.05)
    assert parse_precision("off") == parse_precision("0") == 0.0
    on, off = _topup(0.02, 0.15), _topup(0.0, 0.15)
    assert on == {"ci_target": 0.02, "topup_s": pytest.approx(1.5), "topup_total_s": pytest.approx(60.0),
                  "bucket_ci_target": 0.005, "bucket_topup_s": pytest.approx(6.0),
                  "bucket_min_samples": 24, "bucket_max_samples": 80}
    assert off["topup_s"] == off["topup_total_s"] == off["bucket_topup_s"] == 0.0
    # --bucket-precision off: DDP's bucket sizes as the others; a --precision tighter than it wins there.
    same = _topup(0.02, 0.15, bucket_precision=0.0)
    assert same["bucket_ci_target"] == 0.02 and same["bucket_topup_s"] == pytest.approx(1.5)
    assert _topup(0.001, 0.15)["bucket_ci_target"] == 0.001
    for bad in ("2x", "150%", "-1%", "nan"):
        with pytest.raises(InputError, match="--precision"):
            parse_precision(bad)


def test_the_ranks_time_limit_grows_with_the_top_up_budget_and_a_timeout_says_so(tmp_path):
    from neuronabox.errors import RunFailed
    from neuronabox.fidelity.measure import WorkerPlan

    def plan(**topup):
        return WorkerPlan(["all_reduce"], [4], out=str(tmp_path / "none.json"), **topup)

    default, fine = plan(**_topup(0.02, 0.15)), plan(**_topup(0.02, 0.15, bucket_precision=0.0015))
    assert _time_limit(default, 900.0) == pytest.approx(1020.0)
    # 0.15 % buys 11x the top-up rounds (666 s at the default budget): a fixed 900 s ended one half way
    assert _time_limit(fine, 900.0) == pytest.approx(900.0 + 2 * 400 * 0.15 * (0.005 / 0.0015) ** 2)
    (tmp_path / "rank0.log").write_text("all_reduce 8388608 B  708327.3 us\n")
    with pytest.raises(RunFailed, match=r"did not finish within 1020 s .*coarser --bucket-precision.*: all_reduce 8388608"):
        _read_measured(default, [-15, -15], tmp_path, 1020.0, 1020.05)
    with pytest.raises(RunFailed, match=r"failed \(exit status"):
        _read_measured(default, [1, 0], tmp_path, 1020.0, 12.0)


def synthetic_profile(tmp_path, topology=TWO):
    sizes, times, _ = two_regimes()
    fits = {"all_reduce": fit_piecewise(sizes, times, Op.ALL_REDUCE, n=2)}
    bsizes = default_sizes(4, 1 << 20)
    fits["broadcast"] = fit_piecewise(bsizes, [80e-6 + s / 3e9 for s in bsizes], Op.BROADCAST, n=2)
    meas = {"all_reduce": [{"size": s, "time_s": t, "k": 1, "samples": [t]} for s, t in zip(sizes, times)]}
    doc = make_profile(topology, fits, meas, {"gather": "not here"})
    path = tmp_path / "p.json"
    save_profile(doc, path)
    return path, fits


def test_profile_round_trip(tmp_path):
    path, fits = synthetic_profile(tmp_path)
    raw = json.loads(path.read_text())  # plain JSON: no Infinity
    assert raw["format"] == "neuronabox-calibration/1" and raw["library"]["name"] == "gloo"
    assert raw["topology"]["name"] == "two" and len(raw["topology"]["hash"]) == 16
    from neuronabox.topology.graph import ClusterGraph

    assert raw["network"]["route_bandwidth_Bps"] == pytest.approx(ClusterGraph(TWO).route_bandwidth(0, 1))
    assert raw["unsupported"] == {"gather": "not here"} and len(raw["measurements"]["all_reduce"]) == 27
    assert raw["link_estimate"]["ops"] == ["all_reduce", "broadcast"]
    back = load_profile(path)
    for op, f in fits.items():
        g = back["fits"][Op.parse(op)]
        assert g.segments == f.segments and g.breakpoints == f.breakpoints
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": "other"}')
    with pytest.raises(InputError, match="format"):
        load_profile(bad)
    with pytest.raises(InputError, match="no such file"):
        load_profile(tmp_path / "missing.json")


def test_calibrated_model_answers_from_the_fit_and_scales_by_the_ring_closed_form(tmp_path, monkeypatch):
    path, fits = synthetic_profile(tmp_path)
    monkeypatch.setenv("NBOX_PROFILE", str(path))
    m = create_model(TWO, "calibrated")
    ar = fits["all_reduce"]
    # At the calibrated group size, inside the measured range: the measured points, interpolated
    sizes, times, _ = two_regimes()
    for i in (0, 10, len(sizes) - 1):
        est = m.estimate(Op.ALL_REDUCE, sizes[i], [0, 1])
        assert est.duration == pytest.approx(times[i], rel=1e-12) and est.algorithm == "calibrated measured"
    mid = (sizes[10] + sizes[11]) // 2
    want = times[10] + (times[11] - times[10]) * (mid - sizes[10]) / (sizes[11] - sizes[10])
    assert m.estimate(Op.ALL_REDUCE, mid, [0, 1]).duration == pytest.approx(want, rel=1e-12)
    # Outside it (broadcast was measured up to 1 MiB only in the fit, no table): the fitted line
    for s in (4, 4096, 1 << 20, 64 << 20):
        assert m.estimate(Op.BROADCAST, s, [0, 1]).duration == pytest.approx(fits["broadcast"].time(s), rel=1e-12)
    assert m.estimate(Op.BROADCAST, 4, [0, 1]).algorithm.startswith("calibrated s")
    # 16 ranks on 8 nodes: the segment's alpha and B in 2(n-1) alpha + 2(n-1)/n S/B
    m8 = create_model(EIGHT, "calibrated")
    seg = ar.segment(64 << 20)
    n = 16
    want = 2 * (n - 1) * seg.alpha_s + 2 * (n - 1) / n * (64 << 20) / seg.bandwidth_Bps
    assert m8.estimate(Op.ALL_REDUCE, 64 << 20, range(16)).duration == pytest.approx(want, rel=1e-12)
    # an op that was not measured borrows all-reduce's alpha and B
    ag = m8.estimate(Op.ALL_GATHER, 1 << 20, range(16))
    seg = ar.segment(1 << 20)
    assert ag.duration == pytest.approx(15 * seg.alpha_s + 15 / 16 * (1 << 20) / seg.bandwidth_Bps)
    assert ag.algorithm.startswith("calibrated(all_reduce)")
    # a group inside one node is not the calibrated network: the alpha-beta model answers
    alpha_beta = create_model(EIGHT, "alpha-beta")
    assert m8.estimate(Op.ALL_REDUCE, 1 << 20, [0, 1]).duration == alpha_beta.estimate(Op.ALL_REDUCE, 1 << 20, [0, 1]).duration
    assert m8.estimate(Op.ALL_REDUCE, 1 << 20, [3]).duration == 0.0


def test_calibrated_model_follows_what_if_scales_and_needs_a_profile(tmp_path, monkeypatch):
    path, fits = synthetic_profile(tmp_path)
    monkeypatch.setenv("NBOX_PROFILE", str(path))
    base = create_model(TWO, "calibrated").estimate(Op.BROADCAST, 1 << 20, [0, 1]).duration
    seg = fits["broadcast"].segment(1 << 20)
    slow = create_model(TWO.with_changes(whatif={"latency_scale": 2, "bandwidth_scale": 0.5}), "calibrated")
    got = slow.estimate(Op.BROADCAST, 1 << 20, [0, 1]).duration
    assert got == pytest.approx(2 * seg.latency_s + 2 * seg.sec_per_byte * (1 << 20))
    assert got > base
    monkeypatch.delenv("NBOX_PROFILE")
    with pytest.raises(InputError, match="NBOX_PROFILE"):
        create_model(TWO, "calibrated")


def test_link_estimate_takes_the_median_large_size_bandwidth():
    sizes = default_sizes(1 << 10, 64 << 20)
    fits = {
        "all_reduce": fit_piecewise(sizes, [2e-3 + s / 11e6 for s in sizes], Op.ALL_REDUCE, 2),
        "broadcast": fit_piecewise(sizes, [1e-3 + s / 12e6 for s in sizes], Op.BROADCAST, 2),
    }
    est = link_estimate(fits)
    assert est["ops"] == ["all_reduce", "broadcast"] and est["payload_Bps"] == pytest.approx(11.5e6)
    assert est["all_reduce_payload_Bps"] == pytest.approx(11e6)
    assert math.isclose(est["wire_Bps"], est["payload_Bps"] * 1514 / 1448)


def test_the_cpu_cost_is_measured_where_gradient_buckets_are_not_only_at_the_largest_sizes():
    # 10 Gbit/s-like sweep: 4 B .. 64 MiB, 0.3 ms up to 125 ms.
    rows = [{"size": s, "time_s": 3e-4 + s / 0.55e9} for s in default_sizes(4, 64 << 20)]
    sizes = [r["size"] for r in cpu_cost_rows(rows)]
    assert len(sizes) == 6 and sizes[0] == 64 << 10 and sizes[-1] == 64 << 20
    assert 1 << 20 in sizes or 2 << 20 in sizes  # a DDP first bucket's neighbourhood is measured
    slow = [{"size": s, "time_s": 2e-3 + s / 11e6} for s in default_sizes(4, 64 << 20)]  # 100 Mbit/s: up to 0.2 s
    assert [r["size"] for r in cpu_cost_rows(slow)] == [64 << 10, 128 << 10, 256 << 10, 512 << 10, 1 << 20, 2 << 20]
    assert cpu_cost_rows([{"size": 4, "time_s": 1e-3}]) == []


def test_calibrate_writes_the_profile_the_topology_names_even_before_it_exists(tmp_path):
    from neuronabox.fidelity.calibrate import load_for_calibration

    base = "name: c\ncluster: {nodes: 2}\nnetwork: {type: ring, link: {bandwidth: 1Gbps, latency: 100us}}\n"
    plain = tmp_path / "plain.yaml"
    plain.write_text(base)
    topo, out, was_named = load_for_calibration(plain)
    assert topo.world_size == 2 and out == tmp_path / "plain.profile.json" and not was_named  # beside it, not in the cwd
    named = tmp_path / "named.yaml"
    named.write_text(base + "emulation: {library: gloo, profile: profiles/p.json}\n")
    topo, out, was_named = load_for_calibration(named)  # the profile is what this run is about to write
    assert out == tmp_path / "profiles" / "p.json" and topo.emulation.library == "gloo" and was_named
    bad = tmp_path / "bad.yaml"
    bad.write_text(base.replace("nodes: 2", "nodes: -1") + "emulation: {profile: p.json}\n")
    with pytest.raises(InputError, match="nodes"):
        load_for_calibration(bad)


def test_busy_progress_in_a_profile_reaches_the_emulator(tmp_path, monkeypatch):
    from neuronabox.emu.emulator import Emulator
    from neuronabox.emu.host_effects.host_coupling import HostCoupling

    path, _ = synthetic_profile(tmp_path)
    doc = json.loads(path.read_text())
    doc["busy_progress"] = {"rate": 0.05}
    path.write_text(json.dumps(doc))
    monkeypatch.setenv("NBOX_PROFILE", str(path))
    gloo = topo("cluster: {nodes: 2}\nnetwork: {type: ring, link: {bandwidth: 1Gbps, latency: 100us}}\n"
                "emulation: {library: gloo}\n")
    emu = Emulator(gloo, 0, "calibrated")
    assert emu.effect(HostCoupling).busy_rate == 0.05
    tl = emu.new_timeline((0, 1))
    assert tl.effect(HostCoupling) is not None and tl.effect(HostCoupling).busy_rate == 0.05 and tl.slots == 2
    assert Emulator(gloo, 0, "alpha-beta").effect(HostCoupling) is None  # no profile, no coupling


def test_the_link_time_of_two_ops_at_once_comes_from_the_profile(tmp_path):
    from neuronabox.model.calibrated import CalibratedModel

    path, _ = synthetic_profile(tmp_path)
    doc = json.loads(path.read_text())
    t = topo("cluster: {nodes: 4}\nnetwork: {type: ring, link: {bandwidth: 1Gbps, latency: 100us}}\n"
             "emulation: {library: gloo}\n")
    assert CalibratedModel(t, profile=path).link_time(Op.ALL_REDUCE, 1 << 20, (0, 1)) is None  # not measured
    doc["concurrency"] = {"ranks": 2, "sec_per_byte": 1e-8}
    path.write_text(json.dumps(doc))
    m = CalibratedModel(t, profile=path)
    assert m.link_time(Op.ALL_REDUCE, 1 << 20, (0, 1)) == pytest.approx((1 << 20) * 1e-8)
    # other group sizes and ops by their ring wire factor: all-reduce 2(n-1)/n, broadcast 1
    assert m.link_time(Op.ALL_REDUCE, 1 << 20, (0, 1, 2, 3)) == pytest.approx((1 << 20) * 1e-8 * 1.5)
    assert m.link_time(Op.BROADCAST, 1 << 20, (0, 1)) == pytest.approx((1 << 20) * 1e-8)
    assert m.link_time(Op.ALL_REDUCE, 1 << 20, (0,)) is None


def test_the_link_share_of_two_ops_at_once_depends_on_their_size(tmp_path):
    from neuronabox.model.calibrated import CalibratedModel, pair_sec_per_byte

    # Measured at 10 Gbit/s: small ops' per-op CPU does not overlap, so their bytes hold the
    # link longer per byte than two 64 MiB ops' do.
    pair = {"ranks": 2, "sec_per_byte": 1.4e-9,
            "points": [{"size": 1 << 20, "sec_per_byte": 2.0e-9}, {"size": 4 << 20, "sec_per_byte": 1.6e-9},
                       {"size": 64 << 20, "sec_per_byte": 1.4e-9}]}
    assert pair_sec_per_byte(pair, 1 << 20) == pytest.approx(2.0e-9)
    assert pair_sec_per_byte(pair, 2 << 20) == pytest.approx(1.8e-9)  # halfway in log size
    assert pair_sec_per_byte(pair, 256 << 10) == pytest.approx(2.0e-9)  # below the smallest: the smallest's
    assert pair_sec_per_byte(pair, 1 << 30) == pytest.approx(1.4e-9)
    assert pair_sec_per_byte({"sec_per_byte": 3e-9}, 1 << 20) == 3e-9  # a profile from before: one figure
    path, _ = synthetic_profile(tmp_path)
    doc = json.loads(path.read_text())
    doc["concurrency"] = pair
    path.write_text(json.dumps(doc))
    t = topo("cluster: {nodes: 4}\nnetwork: {type: ring, link: {bandwidth: 1Gbps, latency: 100us}}\n"
             "emulation: {library: gloo}\n")
    m = CalibratedModel(t, profile=path)
    assert m.link_time(Op.ALL_REDUCE, 1 << 20, (0, 1)) == pytest.approx((1 << 20) * 2.0e-9)
    # a broadcast of 2 MiB moves the wire bytes of a 2 MiB all-reduce (n = 2): looked up there
    assert m.link_time(Op.BROADCAST, 2 << 20, (0, 1)) == pytest.approx((2 << 20) * 1.8e-9)


# ---- the intra-node part ---------------------------------------------------------------------------------
def test_the_intra_node_part_measures_one_node_here_and_joins_the_profile(tmp_path):
    from neuronabox.model.calibrated import CalibratedModel
    from neuronabox.topology import load_topology

    from .conftest import run_nbox

    # Two CPU ranks of one node: no namespaces, no root; the node's own fabric (loopback here).
    f = tmp_path / "node.yaml"
    f.write_text("name: node2\ncluster: {nodes: 2, ranks_per_node: 2}\n"
                 "network: {type: ring, link: {bandwidth: 1Gbps, latency: 100us}}\nemulation: {library: gloo}\n")
    t = load_topology(f)
    path, fits = synthetic_profile(tmp_path, t)  # the network part, measured before: kept
    # --precision off: the sweep's passes (the top-up rounds have their own test, test_calibration_robust)
    r = run_nbox("calibrate", str(f), "--part", "intra-node", "--ops", "all_reduce,broadcast", "--sizes", "4B:64KiB",
                 "--budget", "20ms", "--precision", "off", "--profile", str(path))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "intra-node: 2 ranks of one cpu node on this machine, gloo" in r.stdout
    doc = json.loads(path.read_text())
    intra = doc["intra_node"]
    assert intra["ranks"] == 2 and intra["library"]["name"] == "gloo" and set(intra["ops"]) == {"all_reduce", "broadcast"}
    assert set(doc["ops"]) == set(fits)  # the network part is still there
    rows = intra["measurements"]["all_reduce"]
    assert [row["size"] for row in rows] == default_sizes(4, 64 << 10) and all(row["time_s"] > 0 for row in rows)
    m = CalibratedModel(t, profile=path)
    # inside a node: the measured points; across nodes: the network fit, as before
    e = m.estimate(Op.ALL_REDUCE, rows[3]["size"], (0, 1))
    assert e.algorithm == "calibrated intra-node measured" and e.duration == pytest.approx(rows[3]["time_s"])
    assert m.estimate(Op.ALL_REDUCE, 1 << 20, (0, 2)).algorithm.startswith("calibrated ")
    assert "intra-node" not in m.estimate(Op.ALL_REDUCE, 1 << 20, (0, 2)).algorithm
    # a profile of the intra-node part alone answers inside a node and leaves the rest to alpha-beta
    alone = tmp_path / "alone.json"
    r = run_nbox("calibrate", str(f), "--part", "intra-node", "--ops", "all_reduce", "--sizes", "4B:4KiB",
                 "--budget", "10ms", "--profile", str(alone))
    assert r.returncode == 0, r.stdout + r.stderr
    m = CalibratedModel(t, profile=alone)
    assert m.estimate(Op.ALL_REDUCE, 1024, (0, 1)).algorithm.startswith("calibrated intra-node")
    assert not m.estimate(Op.ALL_REDUCE, 1024, (0, 2)).algorithm.startswith("calibrated")


def test_calibrate_says_what_this_machine_cannot_measure(tmp_path):
    import torch

    from .conftest import run_nbox

    one = tmp_path / "one.yaml"
    one.write_text("cluster: {nodes: 2}\nnetwork: {type: ring, link: {bandwidth: 1Gbps, latency: 100us}}\n")
    r = run_nbox("calibrate", str(one), "--part", "intra-node")
    assert r.returncode == 2 and "cluster.ranks_per_node: 1: no intra-node part" in r.stderr
    r = run_nbox("calibrate", str(one), "--part", "nodes")
    assert r.returncode == 2 and "--part: network, intra-node or all" in r.stderr
    if torch.cuda.is_available() and torch.cuda.device_count() >= 2:
        pytest.skip("this machine has GPUs for NCCL: the error below does not apply")
    gpu = tmp_path / "gpu.yaml"
    gpu.write_text("cluster: {nodes: 2, device: H100}\nnetwork: {type: ring, link: {bandwidth: 100Gbps, latency: 5us}}\n"
                   "emulation: {library: nccl}\n")
    r = run_nbox("calibrate", str(gpu))
    assert r.returncode == 2 and "emulation.library: nccl" in r.stderr and "GPUs here" in r.stderr
    assert r.stderr.count("\n") == 1 and not (tmp_path / "gpu.profile.json").exists()  # one line, nothing written
