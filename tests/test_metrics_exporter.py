"""The real rank's exporter without a Prometheus server: names, types, labels, values, the hook, progress."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
import types
import urllib.request

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

import neuronabox.metrics as metrics
from neuronabox.metrics import exporter as ex
from neuronabox.metrics.progress import ProgressWriter, RunProgress, SweepProgress, read_progress

from .conftest import ROOT

TOPO = {
    "name": "exp-test",
    "cluster": {"nodes": 8},
    "network": {"type": "switch", "link": {"bandwidth": "10Gbps", "latency": "10us"}},
    "emulation": {"library": "gloo"},
}


def families(collector) -> dict:
    reg = CollectorRegistry(auto_describe=False)
    reg.register(collector)
    return {f.name: f for f in text_string_to_metric_families(generate_latest(reg).decode())}


def samples(fams: dict, name: str, sample: str | None = None, **labels) -> list:
    return [s for s in fams[name].samples if (sample is None or s.name == sample)
            and all(s.labels.get(k) == v for k, v in labels.items())]


@pytest.fixture
def emu():
    """An in-process emulated cluster of 8 ranks (the nbox backend, no DDP)."""
    torch = pytest.importorskip("torch")
    import neuronabox.emu.api as api

    e = api.init(TOPO)
    yield e, torch
    api.shutdown()


def _iterations(torch, n: int, per_iter: int = 3) -> None:
    import torch.distributed as dist

    import neuronabox.emu.api as api

    x = torch.ones(4096)
    for _ in range(n):
        for _ in range(per_iter):
            dist.all_reduce(x)  # blocking: its wait is exposed communication
            x.fill_(1)
        w = dist.all_reduce(x, async_op=True)  # never waited on in Python: the tail rule
        time.sleep(0.002)
        api.step()
        w.wait()


def test_exposition_names_types_and_values_follow_the_recorder(emu):
    e, torch = emu
    col = ex.RunCollector(run="r1", gpu=False)
    _iterations(torch, 5)
    fams = families(col)
    types_ = {name: f.type for name, f in fams.items()}
    assert types_ == {
        "nbox_info": "gauge",  # the text format has no info type: an info metric is a gauge of 1
        "nbox_emulated_world_size": "gauge",
        "nbox_iteration_duration_seconds": "histogram",
        "nbox_collective_duration_seconds": "histogram",
        "nbox_collective_bytes": "counter",
        "nbox_collectives": "counter",
        "nbox_exposed_communication_seconds": "counter",
        "nbox_process_cpu_seconds": "counter",
        "nbox_process_resident_memory_bytes": "gauge",
    }
    # Every sample carries the cluster (the name `nbox up` gives this topology) and the run.
    for f in fams.values():
        for s in f.samples:
            assert s.labels["cluster"] == "exp_test" and s.labels["run"] == "r1", s
    info = samples(fams, "nbox_info")[0].labels
    assert info["topology"] == "exp-test" and info["world_size"] == "8" and info["real_rank"] == "0"
    assert samples(fams, "nbox_emulated_world_size")[0].value == 8
    rec = e.recorder
    assert samples(fams, "nbox_iteration_duration_seconds", "nbox_iteration_duration_seconds_count")[0].value == 5
    total = samples(fams, "nbox_iteration_duration_seconds", "nbox_iteration_duration_seconds_sum")[0].value
    assert total == pytest.approx(sum(rec.iteration_times()))
    n_ar = sum(1 for r in rec.ops if r.op.value == "all_reduce")
    assert samples(fams, "nbox_collectives", "nbox_collectives_total", op="all_reduce")[0].value == n_ar
    assert samples(fams, "nbox_collective_bytes", "nbox_collective_bytes_total", op="all_reduce")[0].value == n_ar * 4096 * 4
    hist = samples(fams, "nbox_collective_duration_seconds", "nbox_collective_duration_seconds_count", op="all_reduce")
    assert hist and hist[0].labels["group_size"] == "8" and hist[0].labels["algorithm"]
    assert sum(s.value for s in hist) == n_ar
    buckets = samples(fams, "nbox_collective_duration_seconds", "nbox_collective_duration_seconds_bucket", op="all_reduce")
    assert buckets[-1].labels["le"] == "+Inf"
    assert [b.value for b in buckets] == sorted(b.value for b in buckets)  # cumulative
    assert samples(fams, "nbox_process_cpu_seconds", "nbox_process_cpu_seconds_total")[0].value > 0
    assert samples(fams, "nbox_process_resident_memory_bytes")[0].value > 10e6


def test_exposed_seconds_match_the_run_summary(emu):
    from neuronabox.report.run_summary import summarize

    e, torch = emu
    col = ex.RunCollector(run="r1", gpu=False)
    _iterations(torch, 3)
    col.update()  # a scrape half-way must not change the totals
    _iterations(torch, 3)
    fams = families(col)
    rec = e.recorder
    rep = summarize({"iterations": rec.iteration_times(), "ops": [r.as_dict(rec.t0) for r in rec.ops]}, warmup=0)
    expected = rep["exposed_ratio"] * sum(rep["iterations"])
    got = samples(fams, "nbox_exposed_communication_seconds", "nbox_exposed_communication_seconds_total")[0].value
    assert got == pytest.approx(expected, rel=1e-9, abs=1e-12)
    assert got > 0


def test_scrapes_add_up_and_the_training_thread_gets_no_callbacks(emu):
    e, torch = emu
    col = ex.RunCollector(run="r1", gpu=False)
    listeners = list(e.recorder.iteration_listeners)
    _iterations(torch, 2)
    first = families(col)
    _iterations(torch, 3)
    second = families(col)
    count = lambda f: samples(f, "nbox_iteration_duration_seconds", "nbox_iteration_duration_seconds_count")[0].value
    assert (count(first), count(second)) == (2, 5)
    assert e.recorder.iteration_listeners == listeners  # nothing runs on the collective or iteration path


def test_before_any_emulator_only_process_metrics_are_exported():
    col = ex.RunCollector(cluster="c", run="r", emulator_source=lambda: None, gpu=False)
    assert set(families(col)) == {"nbox_process_cpu_seconds", "nbox_process_resident_memory_bytes"}


def test_a_new_emulator_keeps_counters_monotonic():
    from neuronabox.emu.timeline import Recorder

    class FakeEmu:
        def __init__(self):
            self.recorder = Recorder()
            self.topology = types.SimpleNamespace(name="t")
            self.model = types.SimpleNamespace(name="ideal")
            self.world_size, self.real_rank = 4, 0

    current = [FakeEmu()]
    col = ex.RunCollector(cluster="c", run="r", emulator_source=lambda: current[0], gpu=False)
    current[0].recorder.mark_iteration()
    current[0].recorder.mark_iteration()
    col.update()
    current[0] = FakeEmu()
    current[0].recorder.mark_iteration()
    col.update()
    assert sum(col.iteration.counts) == 3


def test_gpu_gauges_come_from_nvml_for_the_visible_devices(monkeypatch):
    class Util:
        gpu = 37

    class Mem:
        used, total = 3 * 2**30, 80 * 2**30

    fake = types.SimpleNamespace(
        nvmlInit=lambda: None,
        nvmlDeviceGetCount=lambda: 4,
        nvmlDeviceGetHandleByIndex=lambda i: f"h{i}",
        nvmlDeviceGetHandleByUUID=lambda u: "h3",
        nvmlDeviceGetIndex=lambda h: int(h[1:]),
        nvmlDeviceGetUtilizationRates=lambda h: Util,
        nvmlDeviceGetMemoryInfo=lambda h: Mem,
        nvmlDeviceGetComputeRunningProcesses=lambda h: [types.SimpleNamespace(pid=os.getpid(), usedGpuMemory=2**30)],
    )
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,GPU-abc")
    col = ex.RunCollector(cluster="c", run="r", emulator_source=lambda: None, gpu=True)
    fams = families(col)
    util = samples(fams, "nbox_gpu_utilization_ratio")
    assert sorted((s.labels["gpu"], s.value) for s in util) == [("2", 0.37), ("3", 0.37)]
    assert samples(fams, "nbox_gpu_memory_total_bytes")[0].value == 80 * 2**30
    assert samples(fams, "nbox_gpu_process_memory_bytes")[0].value == 2**30


def test_no_nvml_means_no_gpu_series(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import fails, as without nvidia-ml-py
    col = ex.RunCollector(cluster="c", run="r", emulator_source=lambda: None, gpu=True)
    assert not any(n.startswith("nbox_gpu") for n in families(col))


@pytest.mark.parametrize(
    "text,expected",
    [("127.0.0.1:9464", ("127.0.0.1", 9464)), (":9464", ("127.0.0.1", 9464)), ("9464", ("127.0.0.1", 9464)),
     ("0.0.0.0:0", ("0.0.0.0", 0)), ("[::1]:9000", ("::1", 9000)),
     ("0.0.0.0", ("0.0.0.0", 9464)), ("localhost", ("localhost", 9464)), ("[::]", ("::", 9464))],
)
def test_parse_addr(text, expected):
    assert ex.parse_addr(text) == expected


@pytest.mark.parametrize("text", ["host:", "127.0.0.1:99999", "x:y", "[::1]9000"])
def test_parse_addr_rejects(text):
    with pytest.raises(ValueError):
        ex.parse_addr(text)


def test_exporter_serves_on_a_free_port_writes_its_address_and_lingers_for_a_last_scrape(tmp_path):
    addr_file = tmp_path / "addr"
    exp = ex.start_exporter("127.0.0.1:0", cluster="c", run="r", emulator_source=lambda: None,
                            address_file=str(addr_file), gpu=False)
    try:
        assert addr_file.read_text().strip() == exp.address and exp.port > 0
        body = urllib.request.urlopen(exp.url, timeout=5).read().decode()
        assert 'nbox_process_resident_memory_bytes{cluster="c",run="r"}' in body
    finally:
        t = time.monotonic()
        exp.close(linger=0.3)  # nobody scrapes again: it gives up after the linger time
        assert 0.25 < time.monotonic() - t < 5


def test_env_names_agree():
    names = ("ENV_ADDR", "ENV_FILE", "ENV_CLUSTER", "ENV_RUN", "ENV_LINGER", "ENV_PORT")
    assert [getattr(metrics, n) for n in names] == [getattr(ex, n) for n in names]
    from neuronabox.metrics import progress

    assert metrics.ENV_PROGRESS == progress.ENV_PROGRESS


HOOK = textwrap.dedent(
    """
    import json, os, subprocess, sys, urllib.request
    import neuronabox.metrics as m
    assert "prometheus_client" not in sys.modules or os.environ.get("NBOX_METRICS_ADDR")
    exp = m.start_from_env()
    again = m.start_from_env()
    out = {"started": exp is not None, "same": again is exp, "prom_loaded": "prometheus_client" in sys.modules}
    if exp is not None:
        out["file"] = open(os.environ["NBOX_METRICS_FILE"]).read().strip() == exp.address
        out["body"] = "nbox_process_cpu_seconds_total" in urllib.request.urlopen(exp.url).read().decode()
        # A Python child (a spawned DataLoader worker) must not start a second exporter.
        child = subprocess.run([sys.executable, "-c", "import neuronabox.metrics as m; print(m.start_from_env() is None)"],
                               capture_output=True, text=True)
        out["child_skipped"] = child.stdout.strip() == "True"
    print(json.dumps(out))
    """
)


def _hook(env_extra: dict) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("NBOX_")} | env_extra
    r = subprocess.run([sys.executable, "-c", HOOK], capture_output=True, text=True, cwd=ROOT, env=env, timeout=60)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_start_from_env_does_nothing_without_the_variables():
    assert _hook({}) == {"started": False, "same": True, "prom_loaded": False}


def test_start_from_env_starts_once_and_not_in_children(tmp_path):
    out = _hook({"NBOX_METRICS_ADDR": "127.0.0.1:0", "NBOX_METRICS_FILE": str(tmp_path / "addr")})
    assert out == {"started": True, "same": True, "prom_loaded": True, "file": True, "body": True, "child_skipped": True}


def test_start_from_env_takes_a_bare_host_and_a_separate_port(tmp_path):
    # What the compose file sets: NBOX_METRICS_ADDR=0.0.0.0, NBOX_METRICS_PORT=9464.
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    addr = tmp_path / "addr"
    out = _hook({"NBOX_METRICS_ADDR": "127.0.0.1", "NBOX_METRICS_PORT": str(port), "NBOX_METRICS_FILE": str(addr)})
    assert out["started"] and out["body"]
    assert addr.read_text().strip() == f"127.0.0.1:{port}"


def test_start_from_env_survives_a_taken_port(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        out = _hook({"NBOX_METRICS_ADDR": f"127.0.0.1:{s.getsockname()[1]}"})
    assert out["started"] is False


# ---- progress -------------------------------------------------------------------------------------
def test_progress_writer_reports_iterations_and_leaves_the_first_out_of_the_median(tmp_path):
    from neuronabox.emu.timeline import Recorder

    rec = Recorder()
    emu = types.SimpleNamespace(recorder=rec, world_size=16)
    w = ProgressWriter(tmp_path / "p.json", emulator_source=lambda: emu)
    assert not w.poll() and read_progress(tmp_path / "p.json") is None
    rec.iteration_marks[:] = [rec.t0 + 1.0, rec.t0 + 1.01, rec.t0 + 1.03, rec.t0 + 1.04]
    assert w.poll()
    p = read_progress(tmp_path / "p.json")
    assert p["iterations"] == 4 and p["world_size"] == 16
    assert p["last_s"] == pytest.approx(0.01) and p["median_s"] == pytest.approx(0.01) and p["p95_s"] == pytest.approx(0.02)
    assert not w.poll()  # nothing new: no write


def test_run_progress_sets_the_env_for_the_child_and_reads_its_file():
    with RunProgress(enabled=False, set_env=True) as prog:
        assert os.environ[metrics.ENV_PROGRESS] == prog.path
        with open(prog.path, "w") as f:
            json.dump({"iterations": 3, "last_s": 0.1, "median_s": 0.1, "p95_s": 0.1}, f)
        assert prog.refresh()["iterations"] == 3
    assert metrics.ENV_PROGRESS not in os.environ
    assert prog.last["iterations"] == 3


def test_no_terminal_no_progress_file():
    with RunProgress(enabled=False):
        assert metrics.ENV_PROGRESS not in os.environ


def test_progress_lines_render_on_a_terminal():
    from rich.console import Console

    console = Console(file=open(os.devnull, "w"), force_terminal=True)
    with RunProgress(console, enabled=True, interval=0.01) as prog:
        with open(prog.path, "w") as f:
            json.dump({"iterations": 3, "last_s": 0.1, "median_s": 0.1, "p95_s": 0.2}, f)
        time.sleep(0.05)
    with SweepProgress(3, "what-if", console=console, enabled=True) as sweep:
        for k in range(3):
            sweep.advance(f"bw x{k}", 0.02)
    assert sweep.done == 3 and prog.last["p95_s"] == 0.2
