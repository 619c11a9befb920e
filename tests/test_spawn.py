"""Spawn-style scripts (the PyTorch DDP tutorial: mp.spawn, its own world_size and MASTER_PORT) under ``nbox run``."""

from __future__ import annotations

import json
import sys

import pytest

from neuronabox.emu.environ import free_port

from .conftest import ROOT, run_nbox

pytest.importorskip("torch", reason="nbox run needs torch")
pytestmark = [pytest.mark.slow, pytest.mark.torch]

SCRIPT = str(ROOT / "examples" / "spawn_ddp.py")


def test_the_tutorials_workers_become_the_real_ranks(tmp_path):
    rep = tmp_path / "run.json"
    r = run_nbox("run", str(ROOT / "topologies" / "cpu-8x1g.yaml"), "--report", str(rep), "--",
                 sys.executable, SCRIPT, "--steps", "4", "--port", str(free_port()))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Finished running basic DDP example on rank 1." in r.stdout
    doc = json.loads(rep.read_text())
    assert doc["real_ranks"] == [0, 1] and doc["world_size"] == 8
    for k in ("0", "1"):  # each worker recorded its own iterations and DDP's all-reduces over the 8 ranks
        one = doc["ranks"][k]
        assert len(one["iterations"]) == 4 and one["per_op"]["all_reduce"]["count"] >= 3
        assert one["communicators"] and all(len(v) == 8 for v in one["communicators"].values())
    assert "next: nbox report" in r.stdout


def test_more_workers_than_the_topology_has_ranks_exits_2_with_one_line(tmp_yaml):
    topo = tmp_yaml("cluster: {nodes: 2}\nnetwork: {type: switch, link: {bandwidth: 1Gbps, latency: 50us}}\n")
    r = run_nbox("run", str(topo), "--", sys.executable, SCRIPT, "--world-size", "3", "--steps", "1",
                 "--port", str(free_port()))
    assert r.returncode == 2, r.stderr[-3000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert "starts 3 workers" in lines[0] and "at least 3 ranks" in lines[0]
