"""The bucket timeline diagnostic: the workload's per-bucket log, and the phases it is read into."""

import json
import sys

import pytest

from .conftest import ROOT, benchmark_module, run_nbox


def bucket_timeline():
    return benchmark_module("bucket_timeline")


def test_phases_are_medians_per_step_with_buckets_in_issue_order():
    # Two steps: forward 2 ms, then two buckets issued during the backward.
    steps = [[0.0, 0.002, 0.010, 0.011], [0.020, 0.023, 0.031, 0.032]]
    buckets = [[100, 0.004, 0.009], [50, 0.003, 0.008],            # logged in completion order
               [100, 0.025, 0.030], [50, 0.024, 0.029]]
    ph = bucket_timeline().phases({"steps": steps, "buckets": buckets}, warmup=0)
    assert ph["iteration"] == pytest.approx(0.0115)
    assert ph["forward"] == pytest.approx(0.0025)
    assert ph["bucket 0 issued"] == pytest.approx(0.001) and ph["bucket 0 all-reduce"] == pytest.approx(0.005)
    assert ph["bucket 1 issued"] == pytest.approx(0.002)
    assert ph["all done after the first issue"] == pytest.approx(0.006)
    assert bucket_timeline().phases({"steps": steps, "buckets": buckets}, warmup=1)["forward"] == pytest.approx(0.003)


def test_the_workload_logs_each_bucket_under_nbox_run(tmp_path):
    pytest.importorskip("torch")
    topo = tmp_path / "topo.yaml"
    topo.write_text("cluster: {nodes: 2, ranks_per_node: 1}\n"
                    "network: {type: ring, link: {bandwidth: 1Gbps, latency: 100us}}\n"
                    "emulation: {library: gloo}\n")
    log = tmp_path / "buckets"
    r = run_nbox("run", str(topo), "-q", "--", sys.executable, str(ROOT / "examples" / "fidelity_models.py"),
                 "--arch", "mlp", "--steps", "4", "--bucket-log", str(log))
    assert r.returncode == 0, r.stderr
    doc = json.loads((tmp_path / "buckets.rank0.json").read_text())
    assert len(doc["steps"]) == 4
    # The MLP's 0.4 M parameters make two buckets per step (DDP's first bucket is 1 MiB), each
    # issued inside the backward and done after it was issued.
    t1, t2 = doc["steps"][-1][1:3]
    last = [b for b in doc["buckets"] if t1 <= b[1] <= t2]
    assert len(last) == 2 and sum(b[0] for b in last) > 1_000_000
    assert all(b[2] >= b[1] for b in doc["buckets"])


def test_keep_copies_a_run_s_bucket_logs_and_an_emulated_run_s_report(tmp_path):
    work, keep = tmp_path / "work", tmp_path / "keep"
    work.mkdir()
    keep.mkdir()
    for rank in (0, 1):
        (work / f"2-1.rank{rank}.json").write_text(f"rank {rank}")
    (work / "report.json").write_text("ops")
    bucket_timeline().keep_run(work, work / "2-1", keep / "2-1", "real")
    assert sorted(p.name for p in keep.iterdir()) == ["2-1.rank0.json", "2-1.rank1.json"]  # the real system has no report
    bucket_timeline().keep_run(work, work / "2-1", keep / "2-1", "model")
    assert (keep / "2-1.report.json").read_text() == "ops" and (keep / "2-1.rank1.json").read_text() == "rank 1"
