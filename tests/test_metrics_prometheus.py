"""The observability stack for real: a Prometheus server scrapes an emulated run and the shaping agent.

A short `nbox run` (DDP plus a few other collectives, 8 emulated ranks) exports its metrics;
a netns cluster of the same topology runs the shaping agent, with some TCP traffic across its
links; a real Prometheus (Debian package `prometheus`) scrapes both every second through the
configuration rendered from compose-templates/prometheus.yml.j2. Then every PromQL expression
of every panel of dashboards/neuronabox.json, and every template variable query, must return
data through Prometheus's HTTP API. GPU panels must be empty when the run has no GPU.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import socket
import subprocess
import sys
import textwrap
import threading
import time
import urllib.error
import urllib.parse
import urllib.request

import pytest

from neuronabox.metrics.scrape import DASHBOARD, render_scrape_config, scrape_target

from .conftest import ROOT

pytest.importorskip("torch", reason="the emulated run needs torch")
pytestmark = [pytest.mark.slow, pytest.mark.torch]

PY = sys.executable
# What `nbox up` names the topology's cluster, and so the exporter's cluster label; the pid keeps
# two test sessions on one machine out of each other's namespaces.
CLUSTER = f"nboxmetrics{os.getpid()}"
TOPOLOGY = f"""
name: {CLUSTER}
cluster: {{nodes: 8}}
network: {{type: switch, link: {{bandwidth: 1Gbps, latency: 50us}}}}
emulation: {{library: gloo}}
"""

WORKLOAD = textwrap.dedent(
    """
    import os, sys, time
    import torch, torch.nn as nn, torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    import neuronabox.metrics

    neuronabox.metrics.start_from_env()  # a no-op once nbox run's autostart starts the exporter itself
    dist.init_process_group("nccl")
    half = dist.new_group([0, 1, 2, 3])
    model = DDP(nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 8)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(32, 64), torch.randint(0, 8, (32,))
    shard, full = torch.ones(1024), torch.empty(8 * 1024)
    stop, deadline = sys.argv[1], time.monotonic() + float(sys.argv[2])
    while not os.path.exists(stop) and time.monotonic() < deadline:
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        dist.all_gather_into_tensor(full, shard)
        if dist.get_rank() in (0, 1, 2, 3):
            dist.all_reduce(shard, group=half)
            shard.fill_(1)
        time.sleep(0.01)  # stands for compute, and leaves the CPUs to Prometheus
        opt.step()
    dist.destroy_process_group()
    """
)

SCRAPE_INTERVAL = "1s"
RATE_INTERVAL = "10s"  # what Grafana's $__rate_interval becomes at a 1 s scrape interval, with margin


# ---- Prometheus -------------------------------------------------------------------------------
def prometheus_binaries() -> tuple[str, str]:
    """prometheus and promtool, installed from Debian's package when missing (root only); else skip."""
    prom, tool = shutil.which("prometheus"), shutil.which("promtool")
    if prom and tool:
        return prom, tool
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        pytest.skip("prometheus is not installed and cannot be (needs root and apt-get): apt-get install prometheus")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update", "-qq"], env=env, capture_output=True, timeout=300)
    r = subprocess.run(["apt-get", "install", "-y", "-qq", "prometheus"], env=env, capture_output=True, text=True, timeout=600)
    prom, tool = shutil.which("prometheus"), shutil.which("promtool")
    if not (prom and tool):
        pytest.skip(f"apt-get install prometheus failed: {(r.stderr or r.stdout).strip().splitlines()[-1:]}")
    return prom, tool


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(predicate, timeout: float, what: str, interval: float = 0.25):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


class Prom:
    """The HTTP API of one Prometheus server."""

    def __init__(self, url: str):
        self.url = url

    def get(self, path: str, **params) -> dict:
        q = urllib.parse.urlencode(params, doseq=True)
        try:
            with urllib.request.urlopen(f"{self.url}{path}?{q}", timeout=10) as r:
                body = json.loads(r.read())
        except urllib.error.HTTPError as exc:
            raise AssertionError(f"Prometheus refused {params}: {exc.read().decode(errors='replace')}") from None
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict]:
        data = self.get("/api/v1/query", query=expr, time=f"{time.time():.3f}")
        assert data["resultType"] == "vector", (expr, data["resultType"])
        return data["result"]

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False


def substitute(expr: str, values: dict[str, str]) -> str:
    """Grafana's variable syntaxes ($x, ${x}, ${x:fmt}, [[x]]) replaced; an unknown variable fails the test."""

    def repl(m: re.Match) -> str:
        name = m.group(1) or m.group(2) or m.group(3)
        assert name in values, f"the dashboard uses ${name}, which neither it nor Grafana defines: {expr}"
        return values[name]

    return re.sub(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)|\[\[(\w+)\]\]", repl, expr)


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text(encoding="utf-8"))


def query_panels() -> list[dict]:
    return [p for p in dashboard()["panels"] if p.get("type") != "row" and p.get("targets")]


def is_gpu_panel(panel: dict) -> bool:
    return all("nbox_gpu_" in t["expr"] for t in panel["targets"])


# ---- the stack -----------------------------------------------------------------------------------
def _traffic(stop: threading.Event, hosts: list[dict]) -> None:
    """TCP bytes from node0 to node1 across the shaped links (through the delay relay), until stopped."""
    from neuronabox.cluster.namespace import Namespace

    a, b = hosts[0], hosts[1]
    srv = Namespace(b["ns"]).socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.bind((b["address"], 0))
    srv.listen(4)
    port = srv.getsockname()[1]

    def sink():
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            with conn:
                while conn.recv(65536):
                    pass

    threading.Thread(target=sink, daemon=True).start()
    payload = b"x" * 65536
    try:
        while not stop.is_set():
            c = Namespace(a["ns"]).socket(socket.AF_INET, socket.SOCK_STREAM)
            with c:
                c.settimeout(5)
                c.connect((b["address"], port))
                c.sendall(payload * 4)
            stop.wait(0.2)
    except OSError:
        pass
    finally:
        srv.close()


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    prom_bin, promtool = prometheus_binaries()
    tmp = tmp_path_factory.mktemp("prom-stack")
    topo_file = tmp / "topology.yaml"
    topo_file.write_text(TOPOLOGY)
    cleanup: list = []
    info: dict = {"tmp": tmp, "promtool": promtool, "agent_reason": None}
    try:
        # The shaping agent of a netns cluster of the same topology (root only).
        agent_target = None
        from neuronabox.cluster import runtime as rt

        ok, why = rt.can_netns()
        if ok:
            old_state = os.environ.get("NBOX_STATE_DIR")
            os.environ["NBOX_STATE_DIR"] = str(tmp / "state")

            def restore_state():
                if old_state is None:
                    os.environ.pop("NBOX_STATE_DIR", None)
                else:
                    os.environ["NBOX_STATE_DIR"] = old_state

            cleanup.append(restore_state)
            res = rt.up(topo_file, runtime="netns", name=CLUSTER)
            cleanup.append(lambda: rt.down(CLUSTER))
            agent_target = urllib.parse.urlparse(res.agent_url).netloc
            from neuronabox.cluster.state import ClusterState

            stop_traffic = threading.Event()
            th = threading.Thread(target=_traffic, args=(stop_traffic, ClusterState.load(CLUSTER)["plan"]["hosts"]), daemon=True)
            th.start()
            cleanup.append(lambda: (stop_traffic.set(), th.join(timeout=10)))
        else:
            info["agent_reason"] = f"no netns cluster here ({why}): the agent's panels cannot be fed"

        # The emulated run, its exporter on a free port (written to a file, so the test finds it).
        script, stop_file, addr_file = tmp / "workload.py", tmp / "stop", tmp / "metrics-addr"
        script.write_text(WORKLOAD)
        env = {**os.environ, "NBOX_METRICS_ADDR": "127.0.0.1:0", "NBOX_METRICS_FILE": str(addr_file),
               "OMP_NUM_THREADS": "1"}
        env.pop("NBOX_METRICS_OWNER", None)
        log = open(tmp / "run.log", "w")
        run = subprocess.Popen(
            [PY, "-m", "neuronabox.cli", "run", str(topo_file), "--report", str(tmp / "run.json"), "--",
             PY, str(script), str(stop_file), "90"],
            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
        )

        def stop_run():
            stop_file.touch()
            try:
                rc = run.wait(timeout=30)
            except subprocess.TimeoutExpired:
                run.kill()
                rc = run.wait()
            log.close()
            # The run must end as it would without the exporter: exit 0, summary and report written.
            assert rc == 0 and (tmp / "run.json").exists(), (tmp / "run.log").read_text()[-3000:]

        cleanup.append(stop_run)
        wait_for(lambda: addr_file.exists() or run.poll() is not None, 60, "the exporter's address file")
        assert run.poll() is None, (tmp / "run.log").read_text()
        rank_target = addr_file.read_text().strip()
        info["rank_target"] = rank_target

        # Prometheus with the rendered configuration.
        targets = [scrape_target("nbox-rank", [rank_target], role="real-rank")]
        if agent_target:
            targets.append(scrape_target("nbox-agent", [agent_target], role="shaping-agent"))
        config = tmp / "prometheus.yml"
        config.write_text(render_scrape_config(CLUSTER, targets, SCRAPE_INTERVAL))
        info["config"] = config
        data_dir = tmp / "prom-data"
        port = free_port()
        prom_log = open(tmp / "prometheus.log", "w")
        prom = subprocess.Popen(
            [prom_bin, f"--config.file={config}", f"--storage.tsdb.path={data_dir}",
             f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn", "--storage.tsdb.retention.time=1h"],
            stdout=prom_log, stderr=subprocess.STDOUT,
        )

        def stop_prometheus():
            prom.terminate()
            try:
                prom.wait(timeout=15)
            except subprocess.TimeoutExpired:
                prom.kill()
                prom.wait()
            prom_log.close()
            shutil.rmtree(data_dir, ignore_errors=True)

        cleanup.append(stop_prometheus)
        api = Prom(f"http://127.0.0.1:{port}")
        wait_for(lambda: api.ready() or prom.poll() is not None, 30, "Prometheus to be ready")
        assert prom.poll() is None, (tmp / "prometheus.log").read_text()

        # Enough scrapes that every rate window of the dashboard holds several samples.
        def scraped(metric: str, n: int = 8) -> bool:
            res = api.query(f"count_over_time({metric}[30s])")
            return bool(res) and min(float(r["value"][1]) for r in res) >= n

        t0 = time.monotonic()
        wait_for(lambda: scraped("nbox_iteration_duration_seconds_count"), 45, "8 scrapes of the real rank")
        if agent_target:
            wait_for(lambda: scraped("nbox_link_transmit_bytes_total"), 20, "8 scrapes of the shaping agent")
        info["waited_s"] = time.monotonic() - t0
        info["exposition"] = urllib.request.urlopen(f"http://{rank_target}/metrics", timeout=5).read().decode()
        info["agent_exposition"] = (
            urllib.request.urlopen(f"http://{agent_target}/metrics", timeout=5).read().decode() if agent_target else ""
        )
        runs = api.query(f'nbox_info{{cluster="{CLUSTER}"}}')
        assert len(runs) == 1, runs
        info["run"] = runs[0]["metric"]["run"]
        info["api"] = api
        info["agent"] = bool(agent_target)
        yield info
    finally:
        errors = []
        for fn in reversed(cleanup):  # every step runs, even after one fails: no namespace or server left behind
            try:
                fn()
            except Exception as exc:  # noqa: BLE001
                errors.append(exc)
        if errors:
            raise errors[0]


def grafana_values(info: dict) -> dict[str, str]:
    """What Grafana substitutes for the dashboard's variables and its own built-ins."""
    # Both are plain names ([A-Za-z0-9_-]), so the regex needs no escaping.
    assert re.fullmatch(r"[\w-]+", info["run"]), info["run"]
    return {
        "cluster": CLUSTER,
        "run": info["run"],
        "datasource": "prometheus",
        "__rate_interval": RATE_INTERVAL,
        "__interval": SCRAPE_INTERVAL,
        "__range": "5m",
    }


# ---- tests ----------------------------------------------------------------------------------------
def test_promtool_accepts_the_rendered_configuration(stack, tmp_path):
    r = subprocess.run([stack["promtool"], "check", "config", str(stack["config"])], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout + r.stderr
    empty = tmp_path / "empty.yml"
    empty.write_text(render_scrape_config(CLUSTER, [], "5s"))
    r = subprocess.run([stack["promtool"], "check", "config", str(empty)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_scraped_samples_carry_cluster_and_run_labels(stack):
    api = stack["api"]
    res = api.query(f'nbox_iteration_duration_seconds_count{{cluster="{CLUSTER}", run="{stack["run"]}"}}')
    assert res and float(res[0]["value"][1]) >= 5
    assert res[0]["metric"]["job"] == "nbox-rank" and res[0]["metric"]["role"] == "real-rank"
    info = api.query(f'nbox_info{{cluster="{CLUSTER}"}}')[0]["metric"]
    assert info["topology"] == CLUSTER and info["world_size"] == "8" and info["real_rank"] == "0"
    if stack["agent"]:
        links = api.query(f'nbox_link_transmit_bytes_total{{cluster="{CLUSTER}"}}')
        assert links and all(r["metric"]["job"] == "nbox-agent" for r in links)
        assert sum(float(r["value"][1]) for r in links) > 0, "the traffic thread's bytes should show on the links"


def test_template_variables_list_the_cluster_and_the_run(stack):
    api = stack["api"]
    variables = {v["name"]: v for v in dashboard()["templating"]["list"]}
    assert {"datasource", "cluster", "run"} <= set(variables)
    found = {}
    for name in ("cluster", "run"):
        q = variables[name]["query"]
        q = q["query"] if isinstance(q, dict) else q
        m = re.fullmatch(r"label_values\((.*),\s*(\w+)\)", q)
        assert m, q
        selector = substitute(m.group(1), grafana_values(stack) | {"cluster": ".*", "run": ".*"})
        found[name] = api.get(f"/api/v1/label/{m.group(2)}/values", **{"match[]": selector})
    assert CLUSTER in found["cluster"]
    assert stack["run"] in found["run"]


@pytest.mark.parametrize("panel", query_panels(), ids=lambda p: p["title"])
def test_every_panel_query_returns_data(stack, panel):
    api, values = stack["api"], grafana_values(stack)
    gpu_run = "nbox_gpu_" in stack["exposition"]
    for t in panel["targets"]:
        expr = substitute(t["expr"], values)
        result = api.query(expr)
        if is_gpu_panel(panel) and not gpu_run:
            # This machine has no GPU (or no nvidia-ml-py): the exporter leaves GPU series out.
            assert result == [], f"{panel['title']}: GPU series without a GPU? {result}"
            continue
        if "nbox_link_" in expr or "nbox_relay_" in expr:
            if not stack["agent"]:
                pytest.skip(stack["agent_reason"])
            if "nbox_relay_" in expr and "nbox_relay_" not in stack["agent_exposition"]:
                # A kernel with netem delays in the kernel: the agent runs no relay, so no series.
                assert result == [], result
                continue
        assert result, f"panel {panel['title']!r}, query {t['refId']}: no data for {expr}"
        numbers = [float(r["value"][1]) for r in result]
        assert any(math.isfinite(v) for v in numbers), f"{panel['title']!r} {t['refId']}: only NaN/Inf {result}"


def test_gpu_panels_are_empty_here_for_a_stated_reason(stack):
    if "nbox_gpu_" in stack["exposition"]:
        pytest.skip("this run has a GPU: its panels were checked for data")
    try:
        import pynvml  # noqa: F401

        reason = "nvidia-ml-py is installed but NVML found no GPU"
    except ImportError:
        reason = "nvidia-ml-py is not installed (the gpu extra)"
    print(f"\nGPU panels empty: {reason}")
    assert "nbox_process_cpu_seconds_total" in stack["exposition"]

