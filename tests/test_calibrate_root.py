"""``nbox calibrate`` for real: 2 namespaces, a 100 Mbit/s tbf link, gloo; the fit finds the link rate; nothing leaks.

Root only (namespaces, qdiscs, iptables). Measured figures are printed (run with -s).
"""

from __future__ import annotations

import json
import os

import pytest

pytest.importorskip("torch", reason="calibration runs gloo")


from neuronabox.fidelity.robust import median_interval  # noqa: E402

from .conftest import run_nbox, stop_nbox_when  # noqa: E402
from .test_validate_root import leftovers  # noqa: E402

pytestmark = [
    pytest.mark.root,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (network namespaces, qdiscs, iptables)"),
]

TOPO = """name: cal100m
cluster: {nodes: 2}
network: {type: ring, link: {bandwidth: 100Mbps, latency: 200us}}
emulation: {library: gloo}
"""


def test_calibrate_fits_the_tbf_rate_within_10_percent(tmp_path, monkeypatch):
    monkeypatch.setenv("NBOX_STATE_DIR", str(tmp_path / "state"))
    topo = tmp_path / "cal.yaml"
    topo.write_text(TOPO)
    out = tmp_path / "profile.json"
    before = leftovers(tmp_path / "state")
    r = run_nbox("calibrate", str(topo), "--ops", "all_reduce,broadcast", "--sizes", "4B:4MiB", "--max-op-time", "300ms",
                 # the sweep's passes only: the top-up rounds (up to 40 s more here) have their own test on a real
                 # group (test_calibration_robust)
                 "--budget", "50ms", "--precision", "off", "--profile", str(out), "--write-topology")
    assert r.returncode == 0, r.stdout + r.stderr
    doc = json.loads(out.read_text())
    est = doc["link_estimate"]
    rate = 100e6 / 8
    print(f"\nfitted payload bandwidth {est['payload_Bps'] * 8 / 1e6:.1f} Mbit/s (median of {est['ops']}), "
          f"all-reduce {est['all_reduce_payload_Bps'] * 8 / 1e6:.1f} Mbit/s, "
          f"as frames {est['wire_Bps'] * 8 / 1e6:.1f} Mbit/s; tbf 100 Mbit/s; {doc['meta']['seconds']:.0f} s")
    # tbf counts Ethernet frames, gloo counts payload (1448 of every 1514 bytes): compare frames
    # with the rate. Payload itself measured 88-95 Mbit/s here (all-reduce lowest: ACKs of both
    # directions share the rate, and each node's receive work runs on its rank's own core, so a
    # busy machine slows it: 81 Mbit/s once in a full suite run, 92 alone).
    assert abs(est["wire_Bps"] - rate) <= 0.10 * rate
    assert abs(est["payload_Bps"] - rate) <= 0.15 * rate
    assert abs(est["all_reduce_payload_Bps"] - rate) <= 0.22 * rate
    for op in ("all_reduce", "broadcast"):
        fit = doc["ops"][op]
        assert fit["n"] == 2 and fit["segments"][0]["lo"] == 0 and fit["segments"][-1]["hi"] is None
        small = doc["measurements"][op][0]["time_s"]
        assert small >= 200e-6  # the relay's one-way delay is on gloo's path
        # every size keeps its samples by round; its time is settled within its own median's interval
        for row in doc["measurements"][op]:
            lo, hi = median_interval(row["samples"])
            assert len(row["samples"]) >= 3 and row["rounds"] >= 3 and lo <= row["time_s"] <= hi
            assert len(row["samples"]) == row["rounds"] * row["per_pass"] and "median_s" in row
    assert doc["topology"]["name"] == "cal100m" and doc["library"]["name"] == "gloo"
    # host coupling: a progress rate under compute (wire-bound at 100 Mbit/s: most of the way on)
    # and gloo's CPU per rank per byte (the same order as a memcpy plus a TCP round and the relay's
    # copy: 9-11 ns/B on one instance of the 2-core machine, 20-27 on a slower one, 56.5 in a full
    # fresh-clone suite on a slow day). The bound catches a unit or fit error, which reads orders of
    # magnitude off; how fast the host is belongs to the benchmarks, not here.
    busy, cpu = doc["busy_progress"], doc["cpu_cost"]
    assert 0.0 <= busy["rate"] <= 1.0 and len(busy["rates"]) == 31
    assert len(busy["lost_compute_s"]) == 2 and all(0.0 <= x <= busy["compute_s"] for x in busy["lost_compute_s"])
    assert 0.1e-9 <= cpu["per_byte_s"] <= 200e-9 and cpu["per_op_s"] >= 0.0
    assert "busy progress:" in r.stdout and "cpu cost per rank:" in r.stdout
    # and its stall: compute windows halving from the op's idle time, 31 samples each, one fit;
    # each beside the smallest swept op that lasts 0.9 of it, with that op's idle samples
    wins = [w["compute_s"] for w in busy["windows"]]
    assert len(wins) == 6 and wins[0] == busy["compute_s"] and all(len(w["samples"]) == 31 for w in busy["windows"])
    assert all(b == pytest.approx(a / 2) for a, b in zip(wins, wins[1:]))
    # the windows chose their ops by the sweep's own medians (``median_s``); ``time_s`` was settled by
    # the neighbouring sizes after (a settled 2.47 ms beside a 2.90 ms window once)
    swept = {r["size"]: r["median_s"] for r in doc["measurements"]["all_reduce"]}
    for w in busy["windows"][1:]:
        assert len(w["idle_samples"]) == 31 and swept[w["size"]] >= 0.9 * w["compute_s"]
        assert all(swept[s] < 0.9 * w["compute_s"] for s in swept if s < w["size"])
    assert [w["size"] for w in busy["windows"]] == sorted((w["size"] for w in busy["windows"]), reverse=True)
    assert 0.0 <= busy["stall_s"] <= wins[0] and 0.0 < busy["rate_after_stall"] <= 1.0 and "ms of compute, then" in r.stdout
    # two all-reduces at once: together no slower than one after the other, and their bytes no
    # faster than the link (frames counted: payload is 1448 of every 1514 bytes)
    pair = doc["concurrency"]
    assert pair["ranks"] == 2 and len(pair["pair_samples"]) == 21 and "two at once:" in r.stdout
    assert "one after the other, by size:" in r.stdout
    assert pair["pair_s"] <= 2.2 * pair["single_s"]
    assert 1 / pair["sec_per_byte"] <= 1.05 * rate * 1448 / 1514
    # and at DDP's bucket sizes below that one, smallest first, the main size last
    sizes = [pt["size"] for pt in pair["points"]]
    assert sizes == sorted(sizes) and sizes[-1] == pair["size"] and all(pt["pair_s"] > 0 for pt in pair["points"])
    # ops issued after compute: per size and gap, samples of (wall excess, CPU excess per rank)
    stall = doc["spin_stall"]
    assert stall["ranks"] == 2 and {c["gap_s"] for c in stall["cells"]} == {0.002, 0.006, 0.02}
    # of 4 B, 256 KiB and 1 MiB, the largest swept size at or below each that took under 50 ms
    # (at 100 Mbit/s 512 KiB takes 45-55 ms, so two sizes or three)
    swept = doc["measurements"]["all_reduce"]
    picks = {max(m["size"] for m in swept if m["size"] <= want and m["time_s"] < 0.05) for want in (4, 256 << 10, 1 << 20)}
    assert {c["size"] for c in stall["cells"]} == picks and "ops issued after compute" in r.stdout
    for c in stall["cells"]:
        # the wall excess keeps its sign (an op can beat the sweep's median), the op's time cannot be negative
        assert len(c["samples"]) >= 5 and all(len(s) == 3 and min(s[1:]) >= 0.0 for s in c["samples"])
        assert all(s[0] > -c["swept_s"] for s in c["samples"])
        assert 0.0 <= c["spun"] <= 1.0
    assert "wrote" in r.stdout and "all_reduce" in r.stdout
    # --write-topology: the file now names its profile (relative), and so uses model calibrated
    assert "set emulation.profile: profile.json" in r.stdout
    assert topo.read_text() == TOPO.replace("{library: gloo}", "{library: gloo, profile: profile.json}")
    from neuronabox.topology import load_topology

    t = load_topology(topo)
    assert t.emulation.model == "calibrated" and t.emulation.profile == str(out.resolve())
    assert leftovers(tmp_path / "state") == before


def test_a_stopped_calibration_takes_down_its_cluster_and_ranks(tmp_path, monkeypatch):
    monkeypatch.setenv("NBOX_STATE_DIR", str(tmp_path / "state"))
    topo = tmp_path / "cal.yaml"
    cores = len(os.sched_getaffinity(0))
    topo.write_text(TOPO.replace("{nodes: 2}", f"{{nodes: {cores + 1}}}"))
    before = leftovers(tmp_path / "state")
    # Stopped in its sweep (killed outright it left the namespaces, agent, relays and ranks behind).
    rc, out, err, _ = stop_nbox_when(["calibrate", str(topo), "--profile", str(tmp_path / "p.json")], "measuring", after_s=2.0)
    assert rc == 128 + 15 and "nbox: stopped by SIGTERM" in err, out + err
    assert leftovers(tmp_path / "state") == before and not (tmp_path / "p.json").exists()
    # More ranks than cores: the profile would time the sharing too, and calibrate says so first.
    assert f"note: {cores + 1} ranks on {cores} cores here" in out.replace("\n", " "), out
