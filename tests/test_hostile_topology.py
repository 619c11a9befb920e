"""Topology values past any sense (issue 31): each is refused by show, up and run with exit 2 and one
line naming the file, the field and the value, within 2 s, and nothing is created."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from neuronabox.errors import TopologyError
from neuronabox.topology import parse_topology
from neuronabox.topology.schema import MAX_NODES, MAX_RANKS_PER_NODE, MAX_WORLD
from neuronabox.units import MAX_BANDWIDTH, MAX_LATENCY, UnitError, parse_bandwidth, parse_latency, parse_ratio

from .conftest import ROOT, TOPOLOGIES

BASE = (TOPOLOGIES / "cpu-2x1g.yaml").read_text()


def _nodes(*names: str) -> str:
    return BASE.replace("  nodes: 2\n", "  nodes:\n" + "".join(f"    - {{name: {n!r}}}\n" for n in names))


# (case, YAML text, fragment naming the field, fragment naming the value or the bound)
CASES = [
    ("ranks_per_node_1e12", BASE.replace("ranks_per_node: 1", "ranks_per_node: 1000000000000"),
     "cluster.ranks_per_node", "1024"),
    ("nested_name", BASE.replace("name: cpu-2x1g", "name: " + "[" * 5000 + "]" * 5000), ":3:", "nested deeper than 32"),
    ("bandwidth_1e30", BASE.replace("bandwidth: 1Gbps", "bandwidth: 1e30Gbps"), "network.link.bandwidth", "100Tbps"),
    ("bandwidth_1e999", BASE.replace("bandwidth: 1Gbps", "bandwidth: 1e999Gbps"), "network.link.bandwidth", "'1e999Gbps'"),
    ("latency_1e999", BASE.replace("latency: 100us", "latency: 1e999s"), "network.link.latency", "'1e999s'"),
    ("latency_1e12", BASE.replace("latency: 100us", "latency: 1e12s"), "network.link.latency", "60s"),
    ("latency_nan", BASE.replace("latency: 100us", "latency: .nan"), "network.link.latency", "nan"),
    ("world_1e9", BASE + "whatif: {world_size: 1000000000}\n", "whatif.world_size", "1000000000"),
    ("world_too_many_nodes", BASE + "whatif: {world_size: 10000000}\n", "whatif.world_size", f"at most {MAX_NODES}"),
    ("nodes_1e12", BASE.replace("  nodes: 2\n", "  nodes: 1000000000000\n"), "cluster.nodes", "1000000000000"),
    ("int_5000_digits", BASE.replace("ranks_per_node: 1", "ranks_per_node: " + "9" * 5000), "", "4300 digits"),
    ("slowdown_inf", BASE.replace("device: cpu", "device: cpu\n  overrides: {0: {compute_slowdown: .inf}}"),
     "cluster.overrides.0.compute_slowdown", "inf"),
    ("name_empty", _nodes("", "b"), "cluster.nodes[0].name", "''"),
    ("name_rf", _nodes("-rf", "b"), "cluster.nodes[0].name", "'-rf'"),
    ("name_help", _nodes("--help", "b"), "cluster.nodes[0].name", "'--help'"),
    ("name_shell", _nodes("$(touch x)", "b"), "cluster.nodes[0].name", "'$(touch x)'"),
    ("name_long", _nodes("n" * 64, "b"), "cluster.nodes[0].name", "nnnn"),
    ("switch_name", BASE.replace("type: ring ", "type: links\n  switches: ['a b']\n  links: [{endpoints: [node0, node1]}]\n  #"),
     "network.switches[0]", "'a b'"),
]


@pytest.mark.parametrize("case,text,field,value", CASES, ids=[c[0] for c in CASES])
def test_refused_at_load(case, text, field, value):
    with pytest.raises(TopologyError) as e:
        parse_topology(text, "bad.yaml")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("bad.yaml") and field in msg and value in msg, msg


def _run(verb: list[str], path: Path, env: dict) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "neuronabox.cli", *verb[:1], str(path), *verb[1:]],
                       capture_output=True, text=True, cwd=path.parent, env=env, timeout=30)
    return r, time.monotonic() - t0


@pytest.mark.parametrize("case,text,field,value", CASES, ids=[c[0] for c in CASES])
def test_refused_by_show_up_and_run_with_one_line_in_2s_and_nothing_created(case, text, field, value, tmp_path):
    path = tmp_path / f"{case}.yaml"
    path.write_text(text)
    state = tmp_path / "state"
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    env = {**os.environ, "NBOX_STATE_DIR": str(state), "TMPDIR": str(tmpdir), "PYTHONPATH": str(ROOT)}
    for verb in (["show"], ["up", "--runtime", "local"], ["run", "--", sys.executable, "-c", "pass"]):
        r, took = _run(verb, path, env)
        lines = (r.stdout + r.stderr).strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1, (verb, r.returncode, lines[:5])
        assert lines[0].startswith(f"nbox: error: {path}") and field in lines[0] and value in lines[0], lines[0]
        assert took < 2.0, (verb, took)
    assert not state.exists() and sorted(p.name for p in tmp_path.iterdir()) == sorted([path.name, "tmp"])
    assert not any(tmpdir.iterdir())


def test_the_bounds_themselves_are_accepted():
    t = parse_topology(BASE.replace("ranks_per_node: 1", f"ranks_per_node: {MAX_RANKS_PER_NODE}")
                       .replace("bandwidth: 1Gbps", "bandwidth: 100Tbps").replace("latency: 100us", "latency: 60s"))
    assert t.world_size == 2 * MAX_RANKS_PER_NODE and t.network.link.bandwidth == MAX_BANDWIDTH
    assert t.network.link.latency == MAX_LATENCY
    t = parse_topology(_nodes("a", "b.c_d-0", "9" * 63))
    assert [n.name for n in t.nodes] == ["a", "b.c_d-0", "9" * 63]


def test_world_bound_counts_overrides_before_building_anything():
    text = BASE.replace("  nodes: 2\n", f"  nodes: {MAX_NODES}\n").replace("ranks_per_node: 1", "ranks_per_node: 101")
    t0 = time.monotonic()
    with pytest.raises(TopologyError, match=f"cluster: {MAX_NODES * 101} ranks: at most {MAX_WORLD}"):
        parse_topology(text)
    assert time.monotonic() - t0 < 5


@pytest.mark.parametrize("parse,value", [
    (parse_bandwidth, "1e30Gbps"), (parse_bandwidth, "1e999Gbps"), (parse_bandwidth, "100.1Tbps"), (parse_bandwidth, "999bps"),
    (parse_latency, "1e12s"), (parse_latency, "1e999s"), (parse_latency, "61s"),
    (parse_ratio, float("nan")), (parse_ratio, "nan"), (parse_ratio, "inf%"), (parse_ratio, 10**5000),
], ids=range(11))
def test_units_refuse_values_past_their_bounds(parse, value):
    with pytest.raises(UnitError) as e:
        parse(value)
    assert len(str(e.value)) < 200
