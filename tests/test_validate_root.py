"""``nbox validate`` end to end: the real 2-rank system in namespaces against model mode; exit codes gate CI; nothing leaks.

Root only (namespaces, qdiscs, iptables).
"""

from __future__ import annotations

import json
import os
import sys
import textwrap

import pytest

pytest.importorskip("torch", reason="validate trains for real")

from neuronabox.cluster.namespace import list_namespaces  # noqa: E402

from .conftest import run_nbox, stop_nbox_when  # noqa: E402

TOPO = """name: val1g
cluster: {nodes: 2}
network: {type: ring, link: {bandwidth: 1Gbps, latency: 100us}}
emulation: {library: gloo}
"""

TINY = textwrap.dedent(
    """
    import torch, torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    model = DDP(torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
    for _ in range(8):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    dist.destroy_process_group()
    """
)


def leftovers(state_dir) -> dict:
    """What a run could leave behind: our namespaces, processes of our clusters, state files."""
    import psutil

    procs = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = " ".join(p.info.get("cmdline") or [])
        try:
            env = p.environ()
        except psutil.Error:
            env = {}
        # The cluster's agent and relay carry our state dir; the ranks carry validate's run id.
        if (env.get("NBOX_STATE_DIR") == str(state_dir) or env.get("TORCHELASTIC_RUN_ID", "").startswith("nbox-validate-")
                or "neuronabox.fidelity.measure" in cmd):
            procs.append(p.pid)
    names = sorted(os.listdir(state_dir)) if os.path.isdir(state_dir) else []
    return {
        "namespaces": sorted(n for n in list_namespaces() if n.startswith(("nbx-val", "nbx-cal"))),
        "processes": procs,
        "state": [n for n in names if not n.startswith(".")],
    }


@pytest.fixture
def files(tmp_path, monkeypatch):
    monkeypatch.setenv("NBOX_STATE_DIR", str(tmp_path / "state"))
    topo = tmp_path / "val.yaml"
    topo.write_text(TOPO)
    script = tmp_path / "tiny.py"
    script.write_text(TINY)
    return topo, script


@pytest.mark.parametrize("tolerance,code", [("0%", 1), ("1000%", 0)])
@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (network namespaces, qdiscs, iptables)")
def test_validate_runs_end_to_end_and_gates_on_the_tolerance(files, tmp_path, tolerance, code):
    import sys

    topo, script = files
    before = leftovers(tmp_path / "state")
    out, prof = tmp_path / "v.json", tmp_path / "here.profile.json"
    # The passing case also calibrates first, on the validation's own cluster, and emulates with that.
    # Its sizes' medians as the sweep's passes leave them (--calibrate-precision off): calibrate's own test tops them up.
    calibrate = (["--calibrate", "--calibrate-ops", "all_reduce", "--calibrate-sizes", "4B:2MiB",
                  "--calibrate-precision", "off", "--calibrate-budget", "50ms", "--profile", str(prof)]
                 if code == 0 else [])
    # The failing case also reruns the real system (real-again), which reads an error and does not gate.
    # It also runs without the load twin (the passing case has it, as by default).
    no_twin = ["--no-twin"] if code == 1 else []
    r = run_nbox("validate", str(topo), "--modes", "model" if code == 0 else "model,real-again", "--warmup", "2",
                 "--repeats", "2" if code == 0 else "1", *no_twin,
                 "--tolerance", tolerance, "--json", str(out), *calibrate, "--", sys.executable, str(script))
    assert r.returncode == code, r.stdout + r.stderr
    v = json.loads(out.read_text())
    assert v["iterations"] == 6 and v["passed"] is (code == 0)
    real, model, *again = v["real"], *v["modes"]
    assert model["mode"] == "model" and model["available"]
    assert (v["twin_ranks"] == []) is (code == 1) and ("load twin: rank" in r.stdout) is (code == 0)
    if code == 1:
        (again,) = again
        assert again["mode"] == "real-again" and len(again["runs"]) == 1 and len(again["runs"][0]) == 6
        assert again["error"] is not None and again["verdict"].startswith("the real system against itself")
        # past the 0% tolerance against itself: said under the table
        assert ("real-again: the real system read" in r.stdout) is (again["error"] != 0)
    assert all(len(run) == 6 for run in real["runs"] + model["runs"])
    assert real["median_s"] > 0 and model["median_s"] > 0 and model["error"] is not None
    print(f"\nreal {real['median_s'] * 1e3:.2f} ms, model {model['median_s'] * 1e3:.2f} ms, error {model['error']:+.2%}, "
          f"real spread {v['real_spread']}")
    assert "error of median" in r.stdout and ("FAIL" in r.stdout) is (code == 1)
    if code == 0:
        assert len(real["runs"]) == 2 and v["real_spread"] is not None
        doc = json.loads(prof.read_text())
        assert doc["format"] == "neuronabox-calibration/1" and set(doc["ops"]) == {"all_reduce"}
        assert max(m["size"] for m in doc["measurements"]["all_reduce"]) == 2 << 20
        assert all(m["rounds"] == 3 for m in doc["measurements"]["all_reduce"])  # no top-up rounds
        assert v["model"] == "calibrated" and v["profile"] == str(prof) and "calibrating all_reduce" in r.stdout
    else:
        assert v["model"] != "calibrated"
    assert leftovers(tmp_path / "state") == before


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (network namespaces, qdiscs, iptables)")
def test_validate_says_when_the_real_ranks_share_cores_and_a_failed_real_system_exits_1(files, tmp_path):
    topo, _ = files
    cores = len(os.sched_getaffinity(0))
    many = tmp_path / "many.yaml"
    many.write_text(TOPO.replace("{nodes: 2}", f"{{nodes: {cores + 1}}}"))
    r = run_nbox("validate", str(many), "--repeats", "1", "--modes", "model", "--", "/bin/false")
    assert r.returncode == 1 and "the real system failed" in r.stderr, r.stderr
    assert f"note: {cores + 1} real ranks on {cores} cores here" in r.stdout.replace("\n", " "), r.stdout
    assert leftovers(tmp_path / "state") == {"namespaces": [], "processes": [], "state": []}


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (network namespaces, qdiscs, iptables)")
def test_a_stopped_validate_takes_down_its_cluster_and_its_runs(files, tmp_path):
    import psutil

    topo, script = files
    # The real system's short run ends; the emulated one trains until stopped.
    script.write_text(TINY.replace("range(8)", "range(8 if os.environ.get('NBOX_RECORD_ONLY') else 10 ** 6)")
                      .replace("import torch,", "import os, torch,"))
    before = leftovers(tmp_path / "state")
    rc, out, err, _ = stop_nbox_when(["validate", str(topo), "--modes", "model", "--warmup", "2", "--repeats", "1",
                               "--", sys.executable, str(script)], "repeat 1 real", after_s=2.0)
    assert rc == 128 + 15 and "nbox: stopped by SIGTERM" in err, out + err
    assert leftovers(tmp_path / "state") == before
    assert not [p.pid for p in psutil.process_iter(["cmdline"]) if str(script) in " ".join(p.info["cmdline"] or [])]


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (network namespaces, qdiscs, iptables)")
def test_validate_against_records_of_a_netns_testbed(files, tmp_path):
    # A netns cluster stands in for two lab machines: each rank runs `nbox record` in its node, as
    # a user would run it around torchrun on each machine; validate then reads those records as
    # the real system and runs only the emulated side.
    from neuronabox.cluster import runtime as rt
    from neuronabox.fidelity.validate import launch_real, run_validation
    from neuronabox.topology import load_topology

    topo_file, script = files
    topo = load_topology(topo_file)
    runs = []
    rt.up(topo, runtime="netns", name="valrec")
    try:
        for k in range(2):
            out = tmp_path / f"rec{k}"
            cmd = [sys.executable, "-m", "neuronabox.cli", "record", "-o", str(out), "--", sys.executable, str(script)]
            rc, codes = launch_real("valrec", topo, cmd, record_only=False, log_dir=None)
            # gloo can abort a rank at teardown, after its last iteration; the record is written
            # before teardown (validate takes such a real run as complete: _teardown_abort_only)
            assert all(c in (0, 128 + 6) for c in codes), codes
            assert sorted(p.name for p in out.glob("rank-*.json")) == ["rank-0.json", "rank-1.json"]
            runs.append(out)
    finally:
        rt.down("valrec")
    recorded = [json.loads((d / "rank-0.json").read_text())["iterations"] for d in runs]
    assert all(len(r) == 8 for r in recorded)
    assert all(len(json.loads((d / "rank-1.json").read_text())["iterations"]) == 8 for d in runs)
    v = run_validation(topo_file, [sys.executable, str(script)], against=runs, modes=["model"], twin=False,
                       repeats=1, tolerance=10.0)
    assert v.against == [str(p) for p in runs] and len(v.real.runs) == 2 and v.modes[0].error is not None
    assert v.real.runs[0] == recorded[0][1:][: v.iterations]  # after the warm-up iteration, as measured
    # Records of another world, or without the validated rank, are refused before anything runs.
    r = run_nbox("validate", str(topo_file), "--against", str(runs[0]), "--rank", "1", "--modes", "real-again", "--",
                 sys.executable, str(script))
    assert r.returncode == 2 and "real-again reruns the real system here" in r.stderr
    (runs[1] / "rank-0.json").unlink()
    r = run_nbox("validate", str(topo_file), "--against", str(runs[1]), "--modes", "model", "--", sys.executable, str(script))
    assert r.returncode == 2 and "no record of rank 0 (has: rank-1.json)" in r.stderr
