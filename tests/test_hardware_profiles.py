"""Hardware profiles: nccl-tests logs read back, profiles fitted to them, shipped ones inherited, bad input refused."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from neuronabox.collectives import Op
from neuronabox.errors import InputError
from neuronabox.fidelity import hardware_fit as hf
from neuronabox.fidelity.nccl_log import LogRow, NcclTestsLog, parse_log, read_log
from neuronabox.model import hardware
from neuronabox.model.hardware import Section
from neuronabox.model.registry import create_model
from neuronabox.report.nccl_tests import format_compare
from neuronabox.topology import load_topology, parse_topology

H100 = """
cluster: {{nodes: {nodes}, ranks_per_node: 8, device: H100}}
intra_node: {{fabric: nvlink, bandwidth: 450GB/s, latency: 1us}}
network: {{type: rail-optimized, nics_per_node: 8, link: {{bandwidth: 400Gbps, latency: 2us}}}}
emulation: {{model: nccl{extra}}}
"""
TRUTH = Section.model_validate(dict(
    launch_us=8, base_us=dict(LL=10, LL128=16, Simple=12), hop_us=dict(LL=1, LL128=2.5, Simple=4),
    channel_GBps=dict(LL=12, LL128=22, Simple=28), efficiency=dict(LL=0.4, LL128=0.8, Simple=0.82),
    nvls_efficiency=0.55,
))
SIZES = [8 << i for i in range(28)]  # 8 B .. 1 GiB
HEADER = "#       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw   busbw #wrong"


def nbox(*args, cwd=None, env=None):
    return subprocess.run([sys.executable, "-m", "neuronabox.cli", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=120, env=env)


def two_node_all_reduce(tmp_path, before_init=""):
    """A two-node H100 topology and a script of one 1 MiB all-reduce (``before_init``: lines it runs first)."""
    (tmp_path / "t.yaml").write_text(H100.format(nodes=2, extra=""))
    (tmp_path / "train.py").write_text(
        "import os, torch, torch.distributed as dist\n" + before_init + "dist.init_process_group('gloo')\n"
        "dist.all_reduce(torch.ones(1 << 18))\ndist.destroy_process_group()\n"
    )


def log_text(times, op="all_reduce", ranks=8, hosts=1, factor=1.75, max_bytes=None, in_place=None):
    """An nccl-tests log of ``times`` (µs), out of place; in place the same unless ``in_place`` gives its times."""
    lines = [f"# nThread 1 nGpus 1 minBytes 8 maxBytes {max_bytes or SIZES[len(times) - 1]} step: 2(factor) warmup iters: 5"]
    lines += [f"#  Rank {i:2d} Group  0 Pid  {100 + i} on  host{i * hosts // ranks} device  {i % 8} [0x{i:02x}] NVIDIA H100 80GB HBM3"
              for i in range(ranks)]
    lines += ["host0:100:100 [0] NCCL INFO NCCL version 2.21.5+cuda12.4", "#", HEADER]
    for s, t, ti in zip(SIZES, times, in_place or times):
        alg, alg_i = s / t / 1e3, s / ti / 1e3
        lines.append(f"{s:12d}  {s // 4:12d}     float     sum      -1  {t:7.2f}  {alg:6.2f}  {alg * factor:6.2f}      0"
                     f"  {ti:7.2f}  {alg_i:6.2f}  {alg_i * factor:6.2f}      0")
    lines.append("# Avg bus bandwidth    : 100.0")
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def truth_times():
    topo = parse_topology(H100.format(nodes=1, extra=", hardware: none"), "t.yaml")
    dummy = NcclTestsLog("x", Op.ALL_REDUCE, tuple(LogRow(s, s // 4, "float", 1, 1, 1, None, 0) for s in SIZES), 8, (), (), None)
    return [t for t, _ in hf.predict(hf.measured_points(topo, dummy), TRUTH)]


# ---- reading logs ------------------------------------------------------------------------------------------------------
def test_log_rows_ranks_hosts_and_version(truth_times):
    log = parse_log(log_text(truth_times), "all_reduce_perf.txt")
    assert log.op is Op.ALL_REDUCE and log.ranks == 8 and log.nodes == 1 and log.nccl_version == "2.21.5"
    assert log.devices == ("NVIDIA H100 80GB HBM3",) and len(log.rows) == len(SIZES)
    assert log.row(1 << 20).time_us == pytest.approx(truth_times[17], abs=0.01)


def test_old_columns_and_interleaved_logging_are_read():
    text = """# nThread 1 nGpus 2 minBytes 1048576 maxBytes 2097152 step: 2(factor) warmup iters: 5 iters: 20 validation: 1
#
#                                                     out-of-place                       in-place
#       size         count    type   redop     time   algbw   busbw  error     time   algbw   busbw  error
#        (B)    (elements)                     (us)  (GB/s)  (GB/s)            (us)  (GB/s)  (GB/s)
     1048576        262144   float     sum    50.00   20.97   20.97  0e+00    50.00   20.97   20.97  0e+00
node1:55:55 [0] NCCL INFO comm 0x1 rank 0 nranks 2 - Init COMPLETE
     2097152        524288   float     sum    90.00   23.30   23.30  0e+00    90.00   23.30   23.30  0e+00
"""
    log = parse_log(text, "x_all_reduce.log", op=Op.ALL_REDUCE, ranks=2)
    assert [r.size for r in log.rows] == [1 << 20, 2 << 20] and log.rows[1].time_us == 90.0


@pytest.mark.parametrize("mutate,needle", [
    (lambda t: t.replace("# Avg bus bandwidth    : 100.0\n", "").rsplit("\n", 3)[0] + "\n", "truncated"),
    (lambda t: t.rsplit("\n", 4)[0] + "\n" + t.rsplit("\n", 4)[1][:30] + "\n", "cut short"),
    (lambda t: t.replace("1048576        262144     float", "1048576        262144     flo\x00"), None),
    (lambda t: "\n".join(ln for ln in t.splitlines() if not ln.strip()[:1].isdigit()), "no nccl-tests rows"),
])
def test_bad_logs_are_refused_naming_the_problem(truth_times, mutate, needle):
    text = mutate(log_text(truth_times))
    if needle is None:
        parse_log(text, "all_reduce_perf.txt")  # a mangled type name is still a row
        return
    with pytest.raises(InputError, match=needle):
        parse_log(text, "all_reduce_perf.txt")


def test_a_log_of_another_collective_is_refused(truth_times):
    # All-gather's busbw is (n-1)/n of algbw, all-reduce's 2(n-1)/n: the rows give the op away.
    text = log_text(truth_times, factor=7 / 8)
    with pytest.raises(InputError, match=r"line \d+: busbw/algbw is 0\.8\d+, not the 1.750 of all_reduce"):
        parse_log(text, "all_reduce_perf.txt")
    with pytest.raises(InputError, match="this is a all_reduce_perf log, not all_gather"):
        parse_log("# ./build/all_reduce_perf -b 8\n" + log_text(truth_times), "x.txt", op=Op.ALL_GATHER)
    with pytest.raises(InputError, match="all_gather_perf.txt: the file is named after all_gather_perf but the log is all_reduce_perf's"):
        parse_log("# Collective test starting: all_reduce_perf\n" + log_text(truth_times), "logs/all_gather_perf.txt")


# ---- profiles ------------------------------------------------------------------------------------------------------------
def synthetic(topo, op, ranks, sizes, times=None):
    """A log of ``sizes`` on ``topo`` as measured points (every time 1 µs unless given)."""
    rows = tuple(LogRow(s, s // 4, "float", t, 1, 1, None, 0) for s, t in zip(sizes, times or [1.0] * len(sizes)))
    return hf.measured_points(topo, NcclTestsLog("x", op, rows, ranks, (), (), None))


def refit(m, network=False):
    """The section fitted on ``m`` alone and its largest relative error on m's own rows."""
    section = hf.fit_section([m], network=network)
    return section, max(abs(t / r.time_us - 1) for r, (t, _) in zip(m.log.rows, hf.predict(m, section)))


def test_fit_recovers_the_times_of_a_known_section(tmp_path, truth_times):
    (tmp_path / "all_reduce_perf.txt").write_text(log_text(truth_times))
    topo = parse_topology(H100.format(nodes=1, extra=""), str(tmp_path / "t.yaml"))
    _, worst = refit(hf.measured_points(topo, read_log(tmp_path / "all_reduce_perf.txt")))
    assert worst < 0.01


def test_half_the_sizes_predict_the_other_half(truth_times):
    topo = parse_topology(H100.format(nodes=1, extra=""), "t.yaml")
    rows = tuple(LogRow(s, s // 4, "float", t, 1, 1, None, 0) for s, t in zip(SIZES, truth_times))
    train = hf.measured_points(topo, NcclTestsLog("x", Op.ALL_REDUCE, rows[0::2], 8, (), (), None))
    test = hf.measured_points(topo, NcclTestsLog("x", Op.ALL_REDUCE, rows[1::2], 8, (), (), None))
    section = hf.fit_section([train], network=False)
    errs = [abs(t / r.time_us - 1) for r, (t, _) in zip(test.log.rows, hf.predict(test, section)) if r.size >= 1 << 20]
    assert max(errs) < 0.05


def test_an_all_to_all_that_ramps_with_its_message_size_per_peer_is_fitted():
    # EFA all-to-alls (aws-p5-*) lose bandwidth at small messages per peer, a curve no latency
    # plus bandwidth follows; the profile's p2p ramp does, and the fit finds it from the log alone.
    topo = parse_topology(H100.format(nodes=2, extra=", hardware: none"), "t.yaml")
    net = TRUTH.model_copy(update=dict(net_hop_us=TRUTH.hop_us, p2p_half_bytes=300e3, p2p_ramp_exponent=0.5))
    sizes = [1 << i for i in range(20, 32)]  # 1 MiB .. 2 GiB
    m = synthetic(topo, Op.ALL_TO_ALL, 16, sizes)
    ramped = [t for t, _ in hf.predict(m, net)]
    flat = [t for t, _ in hf.predict(m, net.model_copy(update=dict(p2p_half_bytes=0.0)))]
    assert ramped[0] > 1.3 * flat[0] and ramped[-1] < 1.06 * flat[-1]  # per peer: 64 KiB vs 128 MiB (+sqrt(0.3/134) = 5 %)
    section, worst = refit(synthetic(topo, Op.ALL_TO_ALL, 16, sizes, ramped), network=True)
    assert worst < 0.01 and section.p2p_half_bytes > 1e4


def test_step_latencies_hide_behind_a_long_transfer_and_the_fit_finds_how_far():
    # PCIe and NVLS logs (l40s-4-*, azure-nd-h100) reach their full bandwidth by 4 MiB: the step
    # latencies overlap the transfer once a channel has several slices in flight.
    topo = parse_topology(H100.format(nodes=1, extra=", hardware: none"), "t.yaml")
    m = synthetic(topo, Op.ALL_REDUCE, 8, SIZES)
    added = [t for t, _ in hf.predict(m, TRUTH)]
    truth = Section.model_validate({**TRUTH.model_dump(), "overlap": 2.5})  # one number: every protocol
    overlapped = [t for t, _ in hf.predict(m, truth)]
    ratios = [o / a for o, a in zip(overlapped, added)]
    assert max(ratios) <= 1 + 1e-9 and min(ratios) < 0.85  # never slower; mid sizes much faster
    assert ratios[0] > 0.99 and ratios[-1] > 0.99  # 8 B: all latency; 1 GiB: all transfer
    fitted, worst = refit(synthetic(topo, Op.ALL_REDUCE, 8, SIZES, overlapped))
    assert worst < 0.02 and fitted.overlap.Simple > 1.5


def test_each_protocol_overlaps_its_own_way_and_the_fit_tells_them_apart():
    # LL and LL128 carry a flag inside every line, so a receiver consumes data as it lands; Simple
    # waits for a flag after each step. l40s-2-pcie-farmshare: LL's small sizes need a knee that
    # Simple's straight line from 256 KiB to 128 MiB does not (own-log fit 3.4 % -> 1.4 %).
    topo = parse_topology(H100.format(nodes=1, extra=", hardware: none"), "t.yaml")
    m = synthetic(topo, Op.ALL_REDUCE, 8, SIZES)
    truth = Section.model_validate({**TRUTH.model_dump(), "overlap": {"LL": 4.0, "LL128": 2.0, "Simple": 1.0}})
    assert Section.model_validate({**TRUTH.model_dump(), "overlap": 2}).overlap.LL128 == 2.0  # one number: all three
    times = [t for t, _ in hf.predict(m, truth)]
    fitted, worst = refit(synthetic(topo, Op.ALL_REDUCE, 8, SIZES, times))
    assert worst < 0.02 and fitted.overlap.LL > 2 * fitted.overlap.Simple, (worst, fitted.overlap)


def test_a_comparison_names_the_rows_the_log_itself_jumps_at_not_their_neighbours():
    # h100-8x8-ib-ndr's published 8 MiB row takes 1272 µs between 204 µs at 4 MiB and 378 µs at 16 MiB:
    # no model follows it, and the user should see that the log, not the model, is rough there.
    sizes = [1 << i for i in range(20, 28)]
    times = [100.0 + s / 50e3 for s in sizes]
    rows = [(s, t, t, 1.0, 1.0, "ring/Simple") for s, t in zip(sizes, times)]
    assert "Off the line" not in format_compare(rows, ["smooth"])
    times[3] *= 4  # 8 MiB
    rows = [(s, t, t, 1.0, 1.0, "ring/Simple") for s, t in zip(sizes, times)]
    flagged = format_compare(rows, ["spike"]).splitlines()[-1]
    assert flagged.startswith("# Off the line") and flagged.endswith(": 8388608 (+75.0%)")  # 3/4 of its time is the jump


def test_a_spike_in_one_of_a_sizes_two_timings_is_read_past(tmp_path, truth_times):
    # nccl-tests times every size twice, out of place and in place. h100-4x8-ib-ndr's published 1 MiB
    # row took 317 µs out of place and 93 µs in place; interference only slows a loop down, so the
    # fit and the comparison take the faster of the two.
    out, inp = list(truth_times), list(truth_times)
    out[SIZES.index(8 << 20)] *= 3.0
    inp[SIZES.index(64 << 20)] *= 1.5
    (tmp_path / "t.yaml").write_text(H100.format(nodes=1, extra=""))
    (tmp_path / "all_reduce_perf.txt").write_text(log_text(out, in_place=inp))
    log = read_log(tmp_path / "all_reduce_perf.txt")
    assert [r.measured_us for r in log.rows] == pytest.approx(truth_times, rel=1e-3)
    assert log.row(8 << 20).time_us == pytest.approx(3 * log.row(8 << 20).measured_us, rel=1e-3)
    r = nbox("calibrate", "t.yaml", "--from-nccl-tests", "all_reduce_perf.txt", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "faster of its out-of-place and in-place times" in r.stdout
    # and the user is told where the log's two loops disagree, and which one was slow
    gaps = next(ln for ln in r.stdout.splitlines() if ln.startswith("# Out of place and in place"))
    assert gaps.endswith(": 8388608 (out-of-place +200.0%), 67108864 (in-place +50.0%)")
    rows = {int(ln.split()[0]): ln.split() for ln in r.stdout.splitlines() if ln.strip()[:1].isdigit()}
    assert float(rows[8 << 20][1]) == pytest.approx(truth_times[SIZES.index(8 << 20)], rel=1e-3)
    assert max(abs(float(v[5].rstrip("%"))) for s, v in rows.items() if s >= 1 << 20) < 1.0  # per cent


def test_calibrate_from_nccl_tests_writes_a_profile_the_topology_then_uses(tmp_path, truth_times):
    (tmp_path / "t.yaml").write_text(H100.format(nodes=1, extra=""))
    (tmp_path / "all_reduce_perf.txt").write_text(log_text(truth_times))
    r = nbox("calibrate", "t.yaml", "--from-nccl-tests", "all_reduce_perf.txt", "--write-topology", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "Largest |error| at >=1 MiB" in r.stdout and (tmp_path / "t.hardware.yaml").exists()
    assert yaml.safe_load((tmp_path / "t.yaml").read_text())["emulation"]["hardware"] == "t.hardware.yaml"
    r = nbox("bench", "t.yaml", "--compare", "all_reduce_perf.txt", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "hardware profile t-hardware" in r.stdout
    big = [float(ln.split()[5].rstrip("%")) for ln in r.stdout.splitlines()
           if ln.strip()[:1].isdigit() and int(ln.split()[0]) >= 1 << 20]
    assert big and max(abs(e) for e in big) < 1.0  # per cent
    # The profile keeps how well it fitted its log, and the model's tables say it where they name it.
    acc = hardware.load_profile(tmp_path / "t.hardware.yaml").accuracy
    assert acc.logs == 1 and acc.unseen_pct is None and acc.by == "nbox calibrate --from-nccl-tests"
    assert acc.largest_pct == pytest.approx(max(abs(e) for e in big), abs=0.06)  # the table prints 0.1 %
    assert acc.mean_pct <= acc.largest_pct
    for args in (("bench", "t.yaml", "--compare", "all_reduce_perf.txt"), ("bench", "t.yaml")):
        out = nbox(*args, cwd=tmp_path).stdout
        assert f"# t-hardware: off by {acc.mean_pct:.1f} % on the log it was fitted on" in out, out


@pytest.mark.parametrize("field,value,needle", [
    ("channel_GBps", {"LL": -1, "LL128": 20, "Simple": 20}, "node.channel_GBps.LL: Input should be greater than 0"),
    ("efficiency", {"LL": 0.5, "LL128": 0.9, "Simple": 1.2}, "node.efficiency.Simple: Input should be less than or equal to 1"),
    ("launch_us", float("nan"), "node.launch_us"),
    ("overlap", {"LL": 0.5, "LL128": 1, "Simple": 1}, "node.overlap.LL: Input should be greater than or equal to 1"),
    ("overlap", 9, "node.overlap.LL: Input should be less than or equal to 8"),
])
def test_impossible_profiles_are_refused_with_exit_2(tmp_path, field, value, needle):
    doc = {"name": "bad", "node": TRUTH.model_dump(exclude_none=True)}
    doc["node"][field] = value
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(doc))
    (tmp_path / "t.yaml").write_text(H100.format(nodes=1, extra=", hardware: bad.yaml"))
    with pytest.raises(InputError, match=needle.replace("(", r"\(")):
        hardware.load_profile(tmp_path / "bad.yaml")
    r = nbox("bench", "t.yaml", cwd=tmp_path)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "bad.yaml" in r.stderr, r.stderr


def test_an_impossible_accuracy_is_refused_naming_its_field(tmp_path):
    doc = {"name": "bad", "node": TRUTH.model_dump(exclude_none=True), "accuracy": {"logs": 2, "mean_pct": -1, "largest_pct": 3}}
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(doc))
    with pytest.raises(InputError, match=r"bad.yaml: accuracy.mean_pct: Input should be greater than or equal to 0 \(got -1\)"):
        hardware.load_profile(tmp_path / "bad.yaml")


def test_a_missing_section_field_and_an_unknown_name_are_refused(tmp_path):
    (tmp_path / "p.yaml").write_text(yaml.safe_dump({"name": "p", "network": TRUTH.model_dump(exclude_none=True)}))
    with pytest.raises(InputError, match="network: Value error, a network section needs net_hop_us"):
        hardware.load_profile(tmp_path / "p.yaml")
    (tmp_path / "t.yaml").write_text(H100.format(nodes=1, extra=", hardware: no-such"))
    r = nbox("bench", "t.yaml", cwd=tmp_path)
    assert r.returncode == 2 and "emulation.hardware: 'no-such' is neither a shipped profile" in r.stderr


def test_hardware_none_keeps_nccls_own_times_and_a_profile_changes_them(tmp_path):
    own = create_model(parse_topology(H100.format(nodes=1, extra=", hardware: none"), "t.yaml"), "nccl")
    (tmp_path / "p.yaml").write_text(yaml.safe_dump({"name": "p", "node": TRUTH.model_dump(exclude_none=True)}))
    timed = create_model(parse_topology(H100.format(nodes=1, extra=", hardware: p.yaml"), str(tmp_path / "t.yaml")), "nccl")
    a, b = own.estimate(Op.ALL_REDUCE, 1 << 30, range(8)), timed.estimate(Op.ALL_REDUCE, 1 << 30, range(8))
    assert b.duration > a.duration * 1.2  # the measured hardware is slower than NCCL's guess
    # The choice is the fastest on the profiled hardware among NCCL's candidates: forcing each
    # candidate never beats it, and a larger size is never faster.
    for algo in ("ring", "tree", "nvls"):
        forced = create_model(timed.topology, "nccl", algorithm=algo).estimate(Op.ALL_REDUCE, 1 << 30, range(8))
        assert forced.duration >= b.duration * (1 - 1e-12)
    times = [timed.estimate(Op.ALL_REDUCE, 1 << k, range(8)).duration for k in range(34)]
    assert all(y >= x for x, y in zip(times, times[1:]))
    # Two nodes: the file has no network section, so a group across nodes is timed as without it
    # (by the shipped profile that matches, if any).
    inherited = create_model(parse_topology(H100.format(nodes=2, extra=""), "t.yaml"), "nccl")
    timed2 = create_model(parse_topology(H100.format(nodes=2, extra=", hardware: p.yaml"), str(tmp_path / "t.yaml")), "nccl")
    assert timed2.estimate(Op.ALL_REDUCE, 1 << 30, range(16)).duration == pytest.approx(
        inherited.estimate(Op.ALL_REDUCE, 1 << 30, range(16)).duration)


def test_a_tree_across_nodes_loads_the_busiest_node_as_nccls_double_binary_tree_does(tmp_path):
    # Two NICs of 400 Gb/s a node (100 GB/s), below NVLink's tree share: the NICs bound the tree.
    # Per extra GiB, a node carries the buffer once with 2 nodes, 1.5 times with 3, twice from 4 on.
    net = TRUTH.model_dump(exclude_none=True) | {
        "net_hop_us": dict(LL=5, LL128=8, Simple=14), "channel_GBps": dict(LL=500, LL128=500, Simple=500)}
    (tmp_path / "p.yaml").write_text(yaml.safe_dump({"name": "p", "network": net}))
    extra = ", hardware: p.yaml, algorithm: tree, protocol: Simple"
    per_gib = {}
    for nodes in (2, 3, 4, 8):
        text = H100.format(nodes=nodes, extra=extra).replace("nics_per_node: 8", "nics_per_node: 2")
        model = create_model(parse_topology(text, str(tmp_path / "t.yaml")), "nccl")
        d1, d2 = (model.estimate(Op.ALL_REDUCE, k << 30, range(8 * nodes)).duration for k in (1, 2))
        per_gib[nodes] = d2 - d1
    assert per_gib[2] == pytest.approx((1 << 30) / (100e9 * TRUTH.efficiency.Simple), rel=1e-6)
    assert [per_gib[n] / per_gib[2] for n in (3, 4, 8)] == pytest.approx([1.5, 2.0, 2.0], rel=1e-6)


def test_shipped_profiles_load_and_are_inherited_by_device_and_fabric():
    shipped = hardware.shipped_profiles()
    assert shipped, "no shipped hardware profiles"
    # A profile without a match (a100-ib-sharp: SHARP runs, which the model has no algorithm for) is
    # selected only where a topology names it.
    published = Path(__file__).resolve().parents[1] / "benchmarks" / "published"
    named = {(yaml.safe_load(t.read_text()).get("emulation") or {}).get("hardware") for t in published.glob("*/topology.yaml")}
    for prof in shipped:
        assert prof.fitted_on and (prof.node or prof.network)
        assert prof.match is not None or prof.name in named, prof.name
    node_profiles = [p for p in shipped if p.node is not None and p.match.intra == "nvlink"
                     and any("H100".startswith(d) for d in p.match.devices)]
    if node_profiles:
        model = create_model(parse_topology(H100.format(nodes=1, extra=""), "t.yaml"), "nccl")
        model.estimate(Op.ALL_REDUCE, 1 << 20, range(8))
        assert node_profiles[0].name in model.hardware_source


def test_shipped_profiles_carry_the_accuracy_the_published_table_reads_and_bench_prints_it(tmp_path):
    # benchmarks/published_accuracy.py --write stores each profile's shipped and leave-one-out
    # columns in it; a user asking nbox bench about their cluster reads what error to expect.
    root = Path(__file__).resolve().parents[1]
    table = json.loads((root / "benchmarks" / "results" / "published_accuracy.json").read_text())["rows"]
    shipped = hardware.shipped_profiles()
    selectable = {p.name for p in shipped if p.match is not None}

    def loo(rows):
        return [hf.large_size_errors(r["cells"]["leave-one-out"]) for r in rows]

    for prof in shipped:
        rows = [r for r in table if r["profile"] == prof.name]
        several = len({r["system"] for r in rows}) > 1
        stood_in = [r for r in table if r["loo_basis"] == f"nearest generation: {prof.name}" and r["profile"] in selectable]
        want = hf.accuracy([hf.large_size_errors(r["cells"]["shipped"]) for r in rows], loo(rows) if several else (),
                           stand_in=loo(stood_in))
        got = prof.accuracy
        assert got is not None and (got.logs, got.stand_in_logs) == (want.logs, want.stand_in_logs), prof.name
        assert (got.mean_pct, got.largest_pct) == pytest.approx((want.mean_pct, want.largest_pct), abs=0.01), prof.name
        for field in ("unseen_pct", "stand_in_pct"):
            a, b = getattr(got, field), getattr(want, field)
            assert (a is None) == (b is None) and (a is None or a == pytest.approx(b, abs=0.01)), (prof.name, field)
    (tmp_path / "t.yaml").write_text(H100.format(nodes=1, extra=""))
    r = nbox("bench", "t.yaml", "-b", "1M", "-e", "2M", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    h100 = next(p for p in hardware.shipped_profiles() if p.node and p.match and p.matches("H100", "nvlink", "ib"))
    assert f"# {h100.name}: off by {h100.accuracy.mean_pct:.1f} % on the {h100.accuracy.logs} logs" in r.stdout, r.stdout
    # A100s over RoCE: the network section stands in from another generation, and bench says so.
    a100 = H100.replace("device: H100", "device: A100").replace("type: rail-optimized", "type: switch, fabric: roce")
    (tmp_path / "a.yaml").write_text(a100.format(nodes=2, extra=""))
    r = nbox("bench", "a.yaml", "-b", "1M", "-e", "2M", cwd=tmp_path)
    near = hardware.nearest(hardware.shipped_profiles(), "A100", "nvlink", "roce", "network")
    assert f"# {near.name} stands in for a GPU generation" in r.stdout, r.stdout
    if near.accuracy.stand_in_pct is not None:  # gcp-a4's B200s over RoCE, left out, were timed by it
        assert f"where it stood in for one, off by {near.accuracy.stand_in_pct:.1f} %" in r.stdout, r.stdout


def test_a_run_on_the_nccl_model_names_its_hardware_profile_and_its_error(tmp_path):
    two_node_all_reduce(tmp_path)
    r = nbox("run", "t.yaml", "--report", "r.json", "--", sys.executable, "train.py", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    report = json.loads((tmp_path / "r.json").read_text())
    model = create_model(parse_topology(H100.format(nodes=2, extra=""), "t.yaml"), "nccl")
    model.estimate(Op.ALL_REDUCE, 1 << 20, range(16))
    assert report["hardware"] == [model.hardware_source, *model.accuracy_notes()]
    assert len(report["hardware"]) == 3  # h100-ib and h100-nvlink, each with its figures
    assert f"hardware   │ profile {model.hardware_source}" in r.stdout, r.stdout  # the summary's row


def test_a_run_takes_nccls_limits_from_the_environment_as_nccl_does(tmp_path):
    # NCCL_PROTO from the launching shell (a cluster's NCCL profile sourced first), NCCL_ALGO set by the script
    # itself before its first communicator: NCCL reads both; the topology leaves them at auto.
    two_node_all_reduce(tmp_path, "os.environ['NCCL_ALGO'] = 'Ring'\n")
    default = create_model(parse_topology(H100.format(nodes=2, extra=""), "t.yaml"), "nccl")
    assert default.estimate(Op.ALL_REDUCE, 1 << 20, range(16)).algorithm != "ring"
    env = {**os.environ, "NCCL_PROTO": "Simple"}
    r = nbox("run", "t.yaml", "--report", "r.json", "--", sys.executable, "train.py", cwd=tmp_path, env=env)
    assert r.returncode == 0, r.stderr
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["nccl_env"] == ["NCCL_ALGO=Ring", "NCCL_PROTO=Simple"]
    assert {o["algorithm"] for o in report["ops"] if o["op"] == "all_reduce"} == {"ring"}
    assert "NCCL environment │ NCCL_ALGO=Ring NCCL_PROTO=Simple" in r.stdout, r.stdout
    # A value NCCL would refuse stops the run before the script starts, naming the variable.
    env["NCCL_PROTO"] = "LL256"
    r = nbox("run", "t.yaml", "--", sys.executable, "train.py", cwd=tmp_path, env=env)
    assert r.returncode == 2 and "environment NCCL_PROTO='LL256'" in r.stderr and len(r.stderr.splitlines()) == 1, r.stderr


def test_nccl_environment_fills_what_the_topology_leaves_open():
    from neuronabox.model.nccl_env import from_environment

    open_topo = parse_topology(H100.format(nodes=1, extra=""), "t.yaml")
    topo, taken = from_environment(open_topo, {"NCCL_NVLS_ENABLE": "0", "NCCL_MIN_NCHANNELS": "4", "NCCL_MIN_CTAS": "8",
                                               "NCCL_DEBUG": "INFO"})
    em = topo.emulation
    assert (em.algorithm, em.min_channels) == ("^nvls,nvls_tree", 8) and taken == ["NCCL_NVLS_ENABLE=0", "NCCL_MIN_CTAS=8"]
    assert create_model(topo, "nccl").estimate(Op.ALL_REDUCE, 1 << 30, range(8)).algorithm == "ring"
    topo, _ = from_environment(open_topo, {"NCCL_ALGO": "NVLS,Tree", "NCCL_NVLS_ENABLE": "0"})
    assert topo.emulation.algorithm == "tree"
    pinned = parse_topology(H100.format(nodes=1, extra=", algorithm: nvls, protocol: Simple"), "t.yaml")
    assert from_environment(pinned, {"NCCL_ALGO": "Ring", "NCCL_PROTO": "LL", "NCCL_NVLS_ENABLE": "0"}) == (pinned, [])
    for env, needle in (({"NCCL_NVLS_ENABLE": "off"}, "expected 0, 1 or 2"), ({"NCCL_MAX_CTAS": "0"}, "from 1 to 64"),
                        ({"NCCL_MIN_CTAS": "16", "NCCL_MAX_CTAS": "4"}, "16 is above its maximum 4")):
        with pytest.raises(InputError, match=needle):
            from_environment(open_topo, env)


def test_a_logs_own_nccl_environment_limits_the_model_that_times_it(tmp_path, truth_times):
    # NCCL_DEBUG=INFO prints what NCCL read; the run was Simple-only, so its comparison and its fit are too.
    info = ("host0:100:100 [0] NCCL INFO NCCL_DEBUG set by environment to INFO\n"
            "host0:100:100 [0] NCCL INFO NCCL_PROTO set by environment to Simple\n")
    text = log_text(truth_times).replace("#\n" + HEADER, info + "#\n" + HEADER)
    log = parse_log(text, "all_reduce_perf.txt")
    assert log.env == (("NCCL_DEBUG", "INFO"), ("NCCL_PROTO", "Simple"))
    topo = parse_topology(H100.format(nodes=1, extra=""), "t.yaml")
    assert hf.measured_points(topo, log).topology.emulation.protocol == "Simple"
    (tmp_path / "t.yaml").write_text(H100.format(nodes=1, extra=""))
    (tmp_path / "all_reduce_perf.txt").write_text(text)
    r = nbox("bench", "t.yaml", "--compare", "all_reduce_perf.txt", cwd=tmp_path)
    assert r.returncode == 0 and "# the log's NCCL environment: NCCL_PROTO=Simple" in r.stdout, r.stderr
    rows = [ln.split() for ln in r.stdout.splitlines() if ln.strip()[:1].isdigit()]
    assert rows and all(row[-1].endswith("/Simple") for row in rows)
    (tmp_path / "all_reduce_perf.txt").write_text(text.replace("to Simple", "to LL256"))
    r = nbox("bench", "t.yaml", "--compare", "all_reduce_perf.txt", cwd=tmp_path)
    assert r.returncode == 2 and "all_reduce_perf.txt: environment NCCL_PROTO='LL256'" in r.stderr, r.stderr


def test_a_generation_without_a_profile_on_a_fabric_takes_the_nearest_generations():
    # A100s over RoCE: no a100-roce profile ships; the network section is the nearest generation's
    # on RoCE (Hopper), newer on a tie, and the report says so. A device of no known generation
    # keeps NCCL's own times.
    shipped = hardware.shipped_profiles()
    near = hardware.nearest(shipped, "A100", "nvlink", "roce", "network")
    assert near is not None and near.matches("H100", "nvlink", "roce")
    a100 = H100.replace("device: H100", "device: A100").replace("type: rail-optimized", "type: switch, fabric: roce")
    model = create_model(parse_topology(a100.format(nodes=2, extra=""), "t.yaml"), "nccl")
    model.estimate(Op.ALL_REDUCE, 1 << 20, range(16))
    assert f"{near.name} (nearest generation)" in model.hardware_source
    assert "a100-nvlink" in model.hardware_source  # its own generation's node section still wins
    assert hardware.nearest(shipped, "MI300X", "nvlink", "roce", "network") is None
    other = create_model(parse_topology(a100.replace("device: A100", "device: MI300X").format(nodes=2, extra=""), "t.yaml"), "nccl")
    other.estimate(Op.ALL_REDUCE, 1 << 20, range(16))
    assert "nearest" not in other.hardware_source


def test_published_dataset_logs_all_parse():
    root = Path(__file__).resolve().parents[1] / "benchmarks" / "published"
    systems = [p for p in root.iterdir() if (p / "system.yaml").exists()]
    assert len(systems) >= 12
    for folder in systems:
        meta = yaml.safe_load((folder / "system.yaml").read_text())
        topo = load_topology(folder / "topology.yaml")
        for entry in meta["logs"]:
            m = hf.measured_points(topo, read_log(folder / entry["file"], ranks=meta["gpus"]))
            assert m.log.rows and m.log.op.value.replace("_", "") == entry["collective"].replace("_", "")


def test_cli_refuses_a_truncated_log_and_a_log_of_another_collective_with_exit_2(tmp_path, truth_times):
    (tmp_path / "t.yaml").write_text(H100.format(nodes=1, extra=""))
    text = log_text(truth_times)
    (tmp_path / "all_reduce_perf.txt").write_text(text[: text.index("  1048576")] + "  1048576  262144  float  sum\n")
    r = nbox("calibrate", "t.yaml", "--from-nccl-tests", "all_reduce_perf.txt", cwd=tmp_path)
    assert r.returncode == 2 and "all_reduce_perf.txt: line" in r.stderr and "cut short" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and not (tmp_path / "t.hardware.yaml").exists()
    (tmp_path / "all_gather_perf.txt").write_text(log_text(truth_times))  # all-reduce rows named all-gather
    r = nbox("bench", "t.yaml", "--compare", "all_gather_perf.txt", cwd=tmp_path)
    assert r.returncode == 2 and "busbw/algbw is 1.750, not the 0.875 of all_gather" in r.stderr, r.stderr


def test_file_names_without_separators_and_a_named_op_pick_the_collective(tmp_path, truth_times):
    from neuronabox.fidelity.nccl_log import op_from_filename

    assert op_from_filename("b200/allgather.txt") is Op.ALL_GATHER  # not gather
    assert op_from_filename("reduce-scatter.log") is Op.REDUCE_SCATTER and op_from_filename("h100_AllReduce.out") is Op.ALL_REDUCE
    assert op_from_filename("gather_perf.txt") is Op.GATHER and op_from_filename("log.txt") is None
    (tmp_path / "t.yaml").write_text(H100.format(nodes=1, extra=""))
    (tmp_path / "log.txt").write_text(log_text(truth_times, factor=7 / 8))  # nothing in the log or its name says
    r = nbox("bench", "t.yaml", "--compare", "log.txt", cwd=tmp_path)
    assert r.returncode == 2 and "does not say which collective" in r.stderr, r.stderr
    r = nbox("bench", "t.yaml", "-o", "all_gather", "--compare", "log.txt", cwd=tmp_path)
    assert r.returncode == 0 and "log.txt: all_gather" in r.stdout, r.stderr
    r = nbox("bench", "t.yaml", "-o", "all_reduce", "--compare", "log.txt", cwd=tmp_path)
    assert r.returncode == 2 and "not the 1.750 of all_reduce" in r.stderr, r.stderr


def test_a_collective_of_no_bytes_costs_nothing_as_nccl_drops_it():
    # NCCL's taskAppend returns before queueing a count-0 collective; nccl-tests reads 0.13-0.25 us for those rows.
    model = create_model(parse_topology(H100.format(nodes=2, extra=""), "t.yaml"), "nccl")
    for op in (Op.ALL_REDUCE, Op.ALL_GATHER, Op.REDUCE_SCATTER, Op.BROADCAST, Op.ALL_TO_ALL):
        assert model.estimate(op, 0, range(16)).duration == 0.0
        assert model.estimate(op, 4096, range(16)).duration > 1e-6
    assert model.estimate(Op.BARRIER, 0, range(16)).duration > 1e-6  # a barrier is a small all-reduce of its own
    # bench --compare shows such rows but counts no error for them.
    text = format_compare([(0, 0.13, 0.0, 0.0, 0.0, "ring/Simple"), (1024, 16.0, 16.8, 0.06, 0.06, "ring/LL")], ["h"])
    assert text.splitlines()[6].split()[-2] == "-" and "below 1 MiB: 5.0% (mean 5.0%, 1 sizes)" in text
