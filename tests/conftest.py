"""Shared fixtures: topologies written as YAML text, the way users write them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from neuronabox.topology import parse_topology

ROOT = Path(__file__).resolve().parent.parent
TOPOLOGIES = ROOT / "topologies"


def topo(text: str, source: str = "test.yaml"):
    """A resolved topology from YAML text."""
    return parse_topology(text, source)


def switch_topology(nodes: int, bandwidth: str = "100Gbps", latency: str = "5us", ranks: int = 1, extra: str = ""):
    """n nodes on one switch."""
    return topo(
        f"cluster: {{nodes: {nodes}, ranks_per_node: {ranks}}}\n"
        f"network: {{type: switch, link: {{bandwidth: {bandwidth}, latency: {latency}}}}}\n" + extra
    )


def run_nbox(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Run the real ``nbox`` command (the console script's entry point) in a subprocess."""
    env = {**os.environ, "COLUMNS": "200"}
    return subprocess.run(
        [sys.executable, "-m", "neuronabox.cli", *args], capture_output=True, text=True, cwd=cwd or ROOT, env=env
    )


def stop_nbox_when(argv: list[str], said: str, after_s: float = 1.0, env: dict[str, str] | None = None,
                   sig: int = 15, to_group: bool = False):
    """Run nbox in a session of its own; ``after_s`` after its output first has a line with ``said``, send it ``sig``.

    ``to_group`` sends the signal to its whole process group, as a terminal's Ctrl-C does.
    Returns its status, stdout, stderr and the seconds from the signal to its exit.
    """
    import signal
    import threading
    import time

    def own_session() -> None:
        os.setsid()
        # A background job (`make test &`) hands its children SIGINT ignored, and Python keeps that.
        signal.signal(signal.SIGINT, signal.SIG_DFL)

    p = subprocess.Popen([sys.executable, "-m", "neuronabox.cli", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, cwd=ROOT, env={**os.environ, "COLUMNS": "200", **(env or {})},
                         preexec_fn=own_session)
    out: list[str] = []
    seen = threading.Event()

    def read() -> None:
        for line in p.stdout:
            out.append(line)
            if said in line:
                seen.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 180
        while not seen.wait(0.5) and p.poll() is None and time.monotonic() < deadline:
            pass
        assert seen.is_set(), "".join(out) + p.stderr.read()
        time.sleep(after_s)
        t0 = time.monotonic()
        if to_group:
            os.killpg(p.pid, sig)
        else:
            p.send_signal(sig)
        err = p.stderr.read()
        rc = p.wait(60)
        took = time.monotonic() - t0
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    reader.join(10)
    return rc, "".join(out), err, took


def benchmark_module(name: str):
    """The script ``benchmarks/<name>.py`` loaded as a module (the benchmarks are scripts, not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture
def tmp_yaml(tmp_path):
    """Write YAML text to a file and return its path."""

    def write(text: str, name: str = "topo.yaml") -> Path:
        p = tmp_path / name
        p.write_text(text)
        return p

    return write


def private_cluster_state(tmp_path_factory, prefix: str):
    """A module's own NBOX_STATE_DIR; clusters left in it are taken down at the end (use with ``yield from``)."""
    from neuronabox.cluster import runtime as rt
    from neuronabox.cluster.state import list_clusters

    old = os.environ.get("NBOX_STATE_DIR")
    d = tmp_path_factory.mktemp(prefix)
    os.environ["NBOX_STATE_DIR"] = str(d)
    yield d
    for name in list_clusters():  # not every entry is a cluster: a broken one's kept agent log
        rt.down(name)
    if old is None:
        os.environ.pop("NBOX_STATE_DIR", None)
    else:
        os.environ["NBOX_STATE_DIR"] = old


# ---- a Docker engine for the docker runtime's tests ---------------------------------------------------
@pytest.fixture(scope="session")
def docker_engine():
    """A Docker SDK client of an engine that answers: the one running, else a dockerd started here (as root)
    and stopped at the end of the session. Skips when neither is possible.

    dockerd keeps its iptables as it found them working: FORWARD policy DROP and its DOCKER chains stay
    after it stops (dockerd's own doing, as on any host that ran it); the netns runtime's tests pass
    with them, since its forwarding happens inside its own namespaces, whose iptables are their own."""
    import shutil
    import signal
    import tempfile
    import time

    from neuronabox.cluster.docker_runtime import docker_sdk, engine_answers

    sdk = docker_sdk()
    if sdk is None:
        pytest.skip("the Docker SDK is not installed (pip install 'neuronabox[docker]')")
    started = None
    if not engine_answers()[0]:
        exe = shutil.which("dockerd")
        if os.geteuid() != 0 or exe is None or os.environ.get("DOCKER_HOST"):
            pytest.skip("no Docker engine answers and none can be started here (needs root and dockerd: make sysdeps)")
        log = tempfile.NamedTemporaryFile(prefix="nbox-test-dockerd-", suffix=".log", delete=False)
        # Its own session, so that a Ctrl-C of pytest does not reach it before the clean-up below.
        started = subprocess.Popen([exe], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 60
        while not engine_answers()[0]:
            if started.poll() is not None or time.monotonic() > deadline:
                started.kill()
                pytest.fail(f"dockerd did not answer (its log: {log.name})")
            time.sleep(0.2)
    try:
        yield sdk.from_env(timeout=300)
    finally:
        if started is not None:
            started.send_signal(signal.SIGTERM)
            try:
                started.wait(60)
            except subprocess.TimeoutExpired:
                started.kill()
                started.wait(10)
