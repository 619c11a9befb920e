"""``nbox report``: the summary and the PNG from a report that a short ``nbox run`` wrote."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

import pytest

from .conftest import ROOT

pytest.importorskip("torch", reason="nbox run needs torch")
pytestmark = [pytest.mark.slow, pytest.mark.torch]

PY = sys.executable
TOPO = """
name: report-test
cluster: {nodes: 4, ranks_per_node: 2}
network: {type: switch, link: {bandwidth: 10Gbps, latency: 10us}}
emulation: {library: gloo}
"""

# `nbox report` until the verb is registered in neuronabox/cli/__init__.py (importing twice is harmless).
NBOX = "import sys, neuronabox.cli.report_cmds; from neuronabox.cli import main; sys.exit(main(sys.argv[1:]))"


def nbox(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "200"}
    return subprocess.run([PY, "-c", NBOX, *args], capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)


@pytest.fixture(scope="module")
def run_report(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("report")
    topo = tmp / "topo.yaml"
    topo.write_text(TOPO)
    rep = tmp / "run.json"
    r = nbox("run", str(topo), "-q", "--report", str(rep), "--", PY, str(ROOT / "examples" / "ddp_train.py"), "--steps", "8")
    assert r.returncode == 0, r.stderr
    return rep


def test_report_prints_the_summary_and_writes_a_png(run_report, tmp_path):
    png = tmp_path / "run.png"
    r = nbox("report", str(run_report), "--png", str(png))
    assert r.returncode == 0, r.stderr
    assert "iteration time" in r.stdout and "exposed comm" in r.stdout and "all_reduce" in r.stdout
    assert f"wrote {png}" in r.stdout
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 30_000
    from PIL import Image  # matplotlib's own dependency

    w, h = Image.open(png).size
    assert w >= 1400 and h >= 700


def test_report_default_png_path_and_chosen_iteration(run_report, tmp_path):
    copy = tmp_path / "copy.json"
    copy.write_text(run_report.read_text())
    r = nbox("report", str(copy), "--iteration", "2")
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "copy.png").exists()


@pytest.mark.parametrize("content,message", [(None, "no such file"), ("{", "not JSON"), ("{}", "not an nbox run report")])
def test_report_bad_input_exits_2_with_one_line(tmp_path, content, message):
    p = tmp_path / "x.json"
    if content is not None:
        p.write_text(content)
    r = nbox("report", str(p))
    assert r.returncode == 2
    assert message in r.stderr and len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr


def test_report_iteration_out_of_range(run_report):
    r = nbox("report", str(run_report), "--iteration", "999", "--no-png")
    assert r.returncode == 2 and "--iteration" in r.stderr


def test_timeline_layout_agrees_with_the_summary(run_report):
    from neuronabox.report.plots import iteration_layout, median_iteration
    from neuronabox.report.run_summary import summarize

    rep = json.loads(run_report.read_text())
    i = median_iteration(rep)
    its = rep["iterations"]
    assert i >= rep["warmup"] and its[i] == statistics.median_low(its[rep["warmup"]:])
    exposed = []
    for k in range(rep["warmup"], len(its)):
        lay = iteration_layout(rep, k)
        covered = sum(b - a for a, b in lay["compute_intervals"] + lay["exposed_intervals"])
        assert covered == pytest.approx(lay["duration"], rel=1e-9, abs=1e-12)  # compute and exposed tile the iteration
        exposed.append(lay["exposed"])
    again = summarize({"iterations": its, "ops": rep["ops"]}, rep["warmup"])
    assert statistics.median(exposed) == pytest.approx(again["exposed_per_iteration"]["median"])


def test_a_real_runs_exposed_number_is_one_number(run_report, tmp_path):
    # The per-op rows add up to the run's exposed time, and the table and the PNG title say it alike.
    from neuronabox.report.plots import suptitle
    from neuronabox.report.run_summary import exposed_headline

    rep = json.loads(run_report.read_text())
    measured = sum(rep["iterations"][rep["warmup"]:])
    per_op = sum(s["exposed_s"] for s in rep["per_op"].values())
    assert per_op == pytest.approx(rep["exposed_ratio"] * measured, rel=1e-9, abs=1e-12)
    r = nbox("report", str(run_report), "--png", str(tmp_path / "x.png"))
    assert r.returncode == 0, r.stderr
    head = exposed_headline(rep)
    assert head in r.stdout and head in suptitle(rep)
    assert rep["per_op"]["all_reduce"]["calls_per_iteration"] >= 1  # DDP's buckets: every iteration alike
