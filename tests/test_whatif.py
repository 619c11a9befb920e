"""nbox whatif: knobs, grid, and a real (short) sweep with its CSV, table and plot."""

import csv
import sys

import pytest

from neuronabox.errors import InputError
from neuronabox.fidelity.whatif import Knob, apply_point, grid, parse_sweep

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
        ("straggler.x=2", "invalid literal"),
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
    assert (out / "whatif.md").read_text().count("\n") == 4
    assert (out / "whatif_inject_all_reduce.png").read_bytes()[:4] == b"\x89PNG"


def test_whatif_bad_usage_exits_2(tmp_path):
    topo = tmp_path / "t.yaml"
    topo.write_text("cluster: {nodes: 4}\nnetwork: {type: switch, link: {bandwidth: 10Gbps}}\n")
    assert run_nbox("whatif", str(topo), "--", "true").returncode == 2
    r = run_nbox("whatif", str(topo), "--sweep", "colour=red", "--", "true")
    assert r.returncode == 2 and "unknown knob" in r.stderr
