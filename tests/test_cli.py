"""The nbox command as users run it: show, bench, schema, models."""

import json

import pytest

from .conftest import TOPOLOGIES, run_nbox


def _rows(stdout: str) -> list[list[str]]:
    return [line.split() for line in stdout.splitlines() if line.strip() and not line.startswith("#")]


def test_bench_prints_the_nccl_tests_table():
    r = run_nbox("bench", str(TOPOLOGIES / "paper-2x1-100g.yaml"), "-b", "8", "-e", "128M", "-f", "2")
    assert r.returncode == 0, r.stderr
    assert "#       size         count      type   redop    root     time   algbw   busbw" in r.stdout
    rows = _rows(r.stdout)
    assert len(rows) == 25  # 8 B .. 128 MiB by factor 2
    size, count, typ, redop, root, time_us, algbw, busbw, algo = rows[-1]
    assert (int(size), int(count), typ, redop, int(root)) == (1 << 27, 1 << 25, "float", "sum", -1)
    # 2 ranks over 100 Gbps: busbw = algbw = S/t, near 12.5 GB/s for large messages
    assert float(algbw) == pytest.approx((1 << 27) / float(time_us) / 1e3, rel=1e-2)
    assert 12.0 < float(busbw) <= 12.5
    assert "# Avg bus bandwidth" in r.stdout


def test_bench_all_ops_json_and_options(tmp_path):
    out = tmp_path / "bench.json"
    r = run_nbox(
        "bench", str(TOPOLOGIES / "cpu-8x1g.yaml"), "--op", "all", "-b", "1K", "-e", "1M", "-f", "4",
        "--algorithm", "ring", "--json", str(out), "--inject", "all_reduce=+1ms", "--ranks", "0-3",
    )
    assert r.returncode == 0, r.stderr
    doc = json.loads(out.read_text())
    assert doc["ranks"] == 4 and doc["model"] == "alpha-beta" and doc["algorithm"] == "ring"
    ops = {row["op"] for row in doc["rows"]}
    assert len(ops) == 10
    ar = [row for row in doc["rows"] if row["op"] == "all_reduce"]
    ag = [row for row in doc["rows"] if row["op"] == "all_gather"]
    assert all(row["time_us"] > 1000 for row in ar)
    assert all(row["time_us"] < 1000 for row in ag[:1])
    assert all(row["size"] % (4 * 4) == 0 for row in ag)  # chunked ops align to ranks x element
    for name in ("AllReduce", "AllGather", "ReduceScatter", "Broadcast", "AlltoAll", "SendRecv"):
        assert f"# Collective: {name}" in r.stdout


def test_bench_json_to_stdout_and_other_models():
    for model in ("alpha-beta", "nccl", "flow"):
        r = run_nbox("bench", str(TOPOLOGIES / "dgx-h100-32.yaml"), "-m", model, "-b", "1M", "-e", "16M", "--json", "-")
        assert r.returncode == 0, (model, r.stderr)
        rows = json.loads(r.stdout)["rows"]
        assert len(rows) == 5 and all(row["busbw_GBps"] > 0 for row in rows)


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["--op", "allfoo"], "--op: unknown collective 'allfoo'"),
        (["-b", "lots"], "--minbytes"),
        (["-b", "1M", "-e", "1K"], "--minbytes/--maxbytes"),
        (["-f", "1"], "--stepfactor"),
        (["--ranks", "0-99"], "--ranks: rank 8"),
        (["--datatype", "float7"], "--datatype"),
        (["--inject", "all_reduce=2"], "--inject"),
        (["--latency-scale", "-1"], "--latency-scale"),
        (["--model", "nope"], "unknown model 'nope'"),
        (["--root", "9"], "--root"),
    ],
)
def test_bench_bad_flags_exit_2(args, fragment):
    r = run_nbox("bench", str(TOPOLOGIES / "cpu-8x1g.yaml"), *args)
    assert r.returncode == 2, r.stderr
    assert fragment in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_show_summary_route_png_and_dot(tmp_path):
    png, dot = tmp_path / "g.png", tmp_path / "g.dot"
    r = run_nbox("show", str(TOPOLOGIES / "dgx-h100-32.yaml"), "--png", str(png), "--dot", str(dot), "--route", "0:9")
    assert r.returncode == 0, r.stderr
    assert "256 ranks on 32 nodes" in r.stdout and "rail-optimized" in r.stdout
    assert "route rank 0 -> rank 9" in r.stdout and "rail1" in r.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert dot.read_text().startswith('graph "dgx-h100-32"')
    bad = run_nbox("show", str(TOPOLOGIES / "dgx-h100-32.yaml"), "--route", "0:9", "--route", "0:999")
    assert bad.returncode == 2 and "--route" in bad.stderr
    assert bad.stdout == "", "a bad --route is refused before the summary is printed"


@pytest.mark.parametrize("site", [False, True], ids=["no packages", "base Python's packages"])
def test_run_with_a_python_that_cannot_load_nbox_says_so_in_one_line(tmp_path, site):
    # The command's Python is not the one nbox is installed in: one without neuronabox's
    # dependencies, or (the base interpreter's packages) one that has them but not torch. site.py
    # would print "Error in sitecustomize" and a traceback hint; nbox says what to do.
    import subprocess
    import sys

    venv = tmp_path / "other"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", *(["--system-site-packages"] if site else []),
                    str(venv)], check=True)
    py = venv / "bin" / "python"
    if site:
        probe = subprocess.run([str(py), "-c", "import yaml, pydantic\ntry:\n import torch\nexcept ImportError:\n pass\n"
                                "else:\n raise SystemExit(1)"], capture_output=True)
        if probe.returncode != 0:
            pytest.skip("the base Python lacks neuronabox's dependencies or has torch")
    r = run_nbox("run", str(TOPOLOGIES / "cpu-8x1g.yaml"), "--", str(py), "-c", "print('ran')")
    assert "ran" in r.stdout
    assert "Error in sitecustomize" not in r.stderr, r.stderr
    assert f"nbox: this Python ({py}) cannot load {'torch' if site else 'neuronabox'}" in r.stderr, r.stderr


def test_show_small_topology_draws_every_vertex(tmp_path):
    png = tmp_path / "small.png"
    r = run_nbox("show", str(TOPOLOGIES / "hetero-a100-h100.yaml"), "--png", str(png))
    assert r.returncode == 0, r.stderr
    assert "A100" in r.stdout and png.exists()


def test_models_lists_builtins():
    r = run_nbox("models")
    assert r.returncode == 0
    for name in ("alpha-beta", "nccl", "flow"):
        assert name in r.stdout


def test_usage_error_exits_2():
    r = run_nbox("bench")
    assert r.returncode == 2


def test_piped_output_uses_120_columns_not_80():
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    r = subprocess.run([sys.executable, "-m", "neuronabox.cli", "show", str(TOPOLOGIES / "cpu-64-demo.yaml")],
                       capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    widths = [len(line) for line in r.stdout.splitlines()]
    assert 80 < max(widths) <= 120, max(widths)
    assert any("node0, node1, node2" in line for line in r.stdout.splitlines()), "the node list is not folded"


def test_signal_exits_leave_an_ignored_signal_ignored():
    import signal

    from neuronabox import cli

    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)  # as under nohup
        cli._install_signal_exits()
        assert signal.getsignal(signal.SIGTERM) is cli._leave_on_signal
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    finally:
        for s, h in saved.items():
            signal.signal(s, h)


def test_bench_names_the_channel_bounds_and_refuses_crossed_ones(tmp_path):
    """emulation.min_channels / max_channels (NCCL_MIN_CTAS / NCCL_MAX_CTAS) show in the header; min above max exits 2."""
    text = ("cluster: {nodes: 2, ranks_per_node: 8, device: H100}\n"
            "network: {type: rail-optimized, link: {bandwidth: 400Gbps, latency: 2us}}\n"
            "emulation: {model: nccl, %s}\n")
    (tmp_path / "t.yaml").write_text(text % "min_channels: 24", encoding="utf-8")
    r = run_nbox("bench", str(tmp_path / "t.yaml"), "-b", "1M", "-e", "1M")
    assert r.returncode == 0, r.stderr
    assert ", min_channels 24" in r.stdout.splitlines()[1]
    (tmp_path / "t.yaml").write_text(text % "min_channels: 24, max_channels: 8", encoding="utf-8")
    r = run_nbox("bench", str(tmp_path / "t.yaml"))
    assert r.returncode == 2 and "t.yaml" in r.stderr and "min_channels 24 is above max_channels 8" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
