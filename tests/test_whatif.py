"""nbox whatif: knobs, grid, and a real (short) sweep with its CSV, table and plot."""

import csv
import sys

import pytest

from neuronabox.errors import InputError
from neuronabox.fidelity.whatif import Knob, WhatIfResult, apply_point, grid, load_outputs, parse_sweep, write_outputs

from .conftest import ROOT, run_nbox, switch_topology


def test_parse_and_grid():
    k1 = parse_sweep("inject=0ms,2ms")
    assert k1 == Knob("inject.all_reduce", ("0ms", "2ms"))
    k2 = parse_sweep("bandwidth_scale=0.5, 1")
    points = grid([k1, k2])
    assert len(points) == 4 and points[1] == {"inject.all_reduce": "0ms", "bandwidth_scale": "1"}


@pytest.mark.parametrize(
    "spec, fragment",
    [
        ("inject.all_reduce", "expected KNOB=V1"),
        ("inject.allfoo=1ms", "unknown collective"),
        ("inject.all_gather=2", "invalid duration"),
        ("latency_scale=0", "greater than zero"),
        ("world_size=-4", "positive"),
        ("straggler.x=2", "names its rank: straggler.RANK="),
        ("straggler=3=2", "names its rank"),
        ("straggler.3=1,fast", "'fast' is not a number"),
        ("bandwidth_scale=1,x", "'x' is not a number"),
        ("world_size=2.5", "'2.5' is not a whole number"),
        ("colour=red", "unknown knob"),
        ("topology=/nope.yaml", "no such topology file"),
    ],
)
def test_bad_knobs(spec, fragment):
    with pytest.raises(InputError, match=fragment):
        parse_sweep(spec)


def test_apply_point_merges_over_the_file():
    base = switch_topology(4, extra="whatif: {inject: {all_gather: 1ms}}\n")
    topo, model = apply_point(base, {"inject.all_reduce": "2ms", "straggler.2": "1.5", "world_size": "8", "model": "flow"})
    assert model == "flow" and topo.world_size == 8
    assert {k.value: v for k, v in topo.whatif.inject.items()} == {"all_gather": 1e-3, "all_reduce": 2e-3}
    assert topo.whatif.stragglers == {2: 1.5}


def test_a_short_sweep_writes_csv_table_and_plot(tmp_path):
    topo = tmp_path / "t.yaml"
    topo.write_text("cluster: {nodes: 4}\nnetwork: {type: switch, link: {bandwidth: 10Gbps, latency: 10us}}\n")
    out = tmp_path / "out"
    r = run_nbox("whatif", str(topo), "--sweep", "inject.all_reduce=0ms,20ms", "-o", str(out),
                 "--", sys.executable, str(ROOT / "examples/ddp_train.py"), "--steps", "5", "--width", "128")
    assert r.returncode == 0, r.stderr[-2000:]
    rows = list(csv.DictReader((out / "whatif.csv").open()))
    assert [row["inject.all_reduce"] for row in rows] == ["0ms", "20ms"]
    slow, fast = float(rows[1]["iteration_median_ms"]), float(rows[0]["iteration_median_ms"])
    assert slow - fast > 15  # at least the last bucket's 20 ms is exposed
    table = (out / "whatif.md").read_text()
    assert sum(line.startswith("|") for line in table.splitlines()) == 4
    assert "can exceed the iteration" in table  # the columns are explained under the table
    assert (out / "whatif_inject_all_reduce.png").read_bytes()[:4] == b"\x89PNG"
    # whatif.json holds what the plots draw: `nbox report` draws them again from it alone.
    results, knobs, context = load_outputs(out / "whatif.json")
    assert [r.point for r in results] == [{"inject.all_reduce": "0ms"}, {"inject.all_reduce": "20ms"}]
    assert results[1].iteration_median_s * 1e3 == pytest.approx(slow, abs=1e-3) and len(results[0].runs) == 1
    assert knobs == [Knob("inject.all_reduce", ("0ms", "20ms"))] and "ddp_train.py" in context
    (out / "whatif_inject_all_reduce.png").unlink()
    r = run_nbox("report", str(out / "whatif.json"))
    assert r.returncode == 0, r.stderr[-2000:]
    assert "iteration median (ms)" in r.stdout and "whatif_inject_all_reduce.png" in r.stdout
    assert (out / "whatif_inject_all_reduce.png").read_bytes()[:4] == b"\x89PNG"
    r = run_nbox("report", str(out / "whatif.json"), "--png", str(tmp_path / "x.png"))
    assert r.returncode == 2 and "one per knob" in r.stderr


def _results() -> tuple[list[WhatIfResult], list[Knob]]:
    knobs = [Knob("inject.all_reduce", ("0ms", "5ms"))]
    return [WhatIfResult({"inject.all_reduce": v}, t, t * 1.1, e, c, [t]) for v, t, e, c in
            (("0ms", 0.1, 0.01, 0.02), ("5ms", 0.11, 0.02, 0.03))], knobs


def test_without_matplotlib_a_sweep_still_writes_its_tables(tmp_path, monkeypatch):
    # A GPU machine with no package index gets neuronabox without its dependencies; matplotlib
    # may be missing there. The sweep's numbers must not be lost with the plots.
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ModuleNotFoundError
    results, knobs = _results()
    written = write_outputs(results, knobs, tmp_path, "ctx")
    assert sorted(p.name for p in written) == ["whatif.csv", "whatif.json", "whatif.md"]
    back, back_knobs, context = load_outputs(tmp_path / "whatif.json")
    assert back == results and back_knobs == knobs and context == "ctx"


def test_load_outputs_names_the_file_and_what_is_wrong(tmp_path):
    f = tmp_path / "whatif.json"
    with pytest.raises(InputError, match="no such file"):
        load_outputs(f)
    f.write_text('{"format": "neuronabox-calibration/1"}')
    with pytest.raises(InputError, match="expected 'neuronabox-whatif/1'"):
        load_outputs(f)
    f.write_text('{"format": "neuronabox-whatif/1", "knobs": [{"name": "x"}], "results": []}')
    with pytest.raises(InputError, match="knobs/results"):
        load_outputs(f)


def test_whatif_bad_usage_exits_2(tmp_path):
    topo = tmp_path / "t.yaml"
    topo.write_text("cluster: {nodes: 4}\nnetwork: {type: switch, link: {bandwidth: 10Gbps}}\n")
    assert run_nbox("whatif", str(topo), "--", "true").returncode == 2
    r = run_nbox("whatif", str(topo), "--sweep", "colour=red", "--", "true")
    assert r.returncode == 2 and "unknown knob" in r.stderr
    # A point the topology cannot take is refused before the progress bar and any run, led by the point.
    four = tmp_path / "four.yaml"
    four.write_text("cluster: {nodes: 2, ranks_per_node: 4}\nnetwork: {type: switch, link: {bandwidth: 10Gbps}}\n")
    r = run_nbox("whatif", str(four), "--sweep", "inject.all_reduce=0ms,1ms", "--sweep", "world_size=8,6",
                 "--", "false")
    assert r.returncode == 2 and "what-if" not in r.stdout, r.stdout
    assert r.stderr.startswith("nbox: error: --sweep inject.all_reduce=0ms, world_size=6: "), r.stderr
    assert "not a multiple of 4 ranks per node" in r.stderr
    # A command that fails is a failed run (exit 1), not bad input.
    r = run_nbox("whatif", str(four), "--sweep", "inject.all_reduce=0ms", "--", "false")
    assert r.returncode == 1 and "the command exited with status 1" in r.stderr, r.stderr
    r = run_nbox("whatif", str(four), "--sweep", "inject.all_reduce=0ms", "--", "true")
    assert r.returncode == 1 and "made no torch.distributed calls" in r.stderr, r.stderr


SLOW_POINT = """
import sys, time
import torch, torch.distributed as dist
with open(sys.argv[1], "a") as f:
    f.write("start\\n")
dist.init_process_group("gloo")
x = torch.ones(64)
opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
for _ in range(int(sys.argv[2])):
    dist.all_reduce(x)
    opt.step()
    time.sleep(0.05)
dist.destroy_process_group()
"""


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_a_stopped_sweep_keeps_the_points_that_ran(tmp_path, sig):
    import signal
    import subprocess
    import time

    topo = tmp_path / "t.yaml"
    topo.write_text("cluster: {nodes: 4}\nnetwork: {type: switch, link: {bandwidth: 10Gbps, latency: 10us}}\n")
    script, starts, out = tmp_path / "slow.py", tmp_path / "starts", tmp_path / "out"
    script.write_text(SLOW_POINT)
    p = subprocess.Popen([sys.executable, "-m", "neuronabox.cli", "whatif", str(topo), "--sweep", "inject.all_reduce=0ms,1ms,2ms",
                          "-o", str(out), "--", sys.executable, str(script), str(starts), "12"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                         # Ctrl-C reaches a terminal's foreground job; a suite run as a background
                         # job (`make test &`) hands its children SIGINT ignored, and Python keeps that.
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and (not starts.exists() or starts.read_text().count("start") < 2):
        time.sleep(0.05)  # the second point's run has begun: the first one finished
    p.send_signal(getattr(signal, sig))
    stdout, stderr = p.communicate(timeout=60)
    assert p.returncode == 128 + getattr(signal, sig), stdout + stderr
    assert f"nbox: error: stopped by {sig} after 1 of 3 runs" in stderr and "partial: 1 of 3 points" in stdout, stdout + stderr
    rows = list(csv.DictReader((out / "whatif.csv").open()))
    assert [row["inject.all_reduce"] for row in rows] == ["0ms"] and float(rows[0]["iteration_median_ms"]) > 40
