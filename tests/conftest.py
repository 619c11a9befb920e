"""Shared fixtures: topologies written as YAML text, the way users write them."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
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


def own_session() -> None:
    """``preexec_fn`` of a child started as a terminal would: a session of its own, SIGINT at its default."""
    import signal

    os.setsid()
    # A background job (`make test &`) hands its children SIGINT ignored, and Python keeps that.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def stop_nbox_when(argv: list[str], said: str, after_s: float = 1.0, env: dict[str, str] | None = None,
                   sig: int = 15, to_group: bool = False):
    """Run nbox in a session of its own; ``after_s`` after its output first has a line with ``said``, send it ``sig``.

    ``to_group`` sends the signal to its whole process group, as a terminal's Ctrl-C does.
    Returns its status, stdout, stderr and the seconds from the signal to its exit.
    """
    import signal
    import threading
    import time

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
class _Engine:
    """The engine of this session: a client, the dockerd started here (if any), and the early image build."""

    client = None
    started: subprocess.Popen | None = None
    host_before = None  # the host's network before the dockerd started here (dockerd_host.snapshot)
    log: str | None = None  # that dockerd's log, removed when it stopped cleanly
    skip: str | None = None
    build = None  # a Future of images.build(), started as soon as the docker tests are collected


def _start_engine() -> None:
    """Find an engine that answers, else start dockerd (as root); ``_Engine.skip`` says why neither."""
    import shutil
    import tempfile
    import time

    from neuronabox.cluster.docker_runtime import docker_sdk, engine_answers

    sdk = docker_sdk()
    if sdk is None:
        _Engine.skip = "the Docker SDK is not installed (pip install 'neuronabox[docker]')"
        return
    if not engine_answers()[0]:
        exe = shutil.which("dockerd")
        if os.geteuid() != 0 or exe is None or os.environ.get("DOCKER_HOST"):
            _Engine.skip = "no Docker engine answers and none can be started here (needs root and dockerd: make sysdeps)"
            return
        from .dockerd_host import snapshot

        log = tempfile.NamedTemporaryFile(prefix="nbox-test-dockerd-", suffix=".log", delete=False)
        _Engine.log = log.name
        # What dockerd will change (iptables, docker0, forwarding), put back when it stops (pytest_sessionfinish).
        _Engine.host_before = snapshot()
        # Its own session, so that a Ctrl-C of pytest does not reach it before the clean-up below.
        _Engine.started = subprocess.Popen([exe], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 60
        while not engine_answers()[0]:
            if _Engine.started.poll() is not None or time.monotonic() > deadline:
                _Engine.started.kill()
                _Engine.started.wait(10)
                _Engine.started = None
                _restore_host()
                _Engine.skip = None
                raise RuntimeError(f"dockerd did not answer (its log: {log.name})")
            time.sleep(0.2)
    _Engine.client = sdk.from_env(timeout=300)


def pytest_collection_finish(session) -> None:
    """With the docker tests selected, start the engine and the (cold: minutes) image build now, beside the rest.

    A cold build mostly waits on the Debian mirror; made while the tests before the docker ones
    run, it costs the suite little of its 2-3 minutes."""
    if session.config.option.collectonly or os.geteuid() != 0:
        return
    if not any(i.nodeid.startswith("tests/test_docker_engine.py") for i in session.items):
        return
    from concurrent.futures import ThreadPoolExecutor

    try:
        _start_engine()
    except RuntimeError:
        return  # the fixture tries again and fails with the reason
    if _Engine.client is None:
        return
    from neuronabox.cluster import images

    log = open(os.path.join(os.environ.get("TMPDIR", "/tmp"), "nbox-test-images-build.log"), "w")  # noqa: SIM115
    pool = ThreadPoolExecutor(1, thread_name_prefix="nbox-images-build")
    t0 = time.monotonic()  # the log's seconds say what a cold build costs (issue 29: at most 3 minutes)
    _Engine.build = pool.submit(images.build, client=_Engine.client,
                                progress=lambda m: print(f"{time.monotonic() - t0:6.1f} s  {m}", file=log, flush=True))
    pool.shutdown(wait=False)


def _restore_host() -> list[str]:
    """Put the host's network back as it was before the dockerd started here; what still differs after."""
    from .dockerd_host import differences, restore, snapshot

    before, _Engine.host_before = _Engine.host_before, None
    if before is None:
        return []
    restore(before)
    return differences(before, snapshot())


def pytest_sessionfinish(session, exitstatus) -> None:
    """Stop the dockerd this session started (after the early build, which a stop would otherwise break),
    and take back what it changed in the host's network; a change left is reported and fails the run."""
    import signal

    if _Engine.build is not None:
        with contextlib.suppress(Exception):
            _Engine.build.result(timeout=600)
    started, _Engine.started = _Engine.started, None
    if started is None:
        return  # an engine that was running before the tests is not ours: nor is what it did to the host
    started.send_signal(signal.SIGTERM)
    try:
        clean = started.wait(60) == 0
    except subprocess.TimeoutExpired:
        started.kill()
        started.wait(10)
        clean = False
    if clean and _Engine.log:
        with contextlib.suppress(OSError):
            os.unlink(_Engine.log)  # kept only when dockerd did not stop as asked
    left = _restore_host()
    if left:
        tr = session.config.pluginmanager.get_plugin("terminalreporter")
        say = tr.write_line if tr else (lambda m: print(m, file=sys.stderr))
        say(f"the dockerd started for the tests left the host changed: {'; '.join(left)}")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture(scope="session")
def docker_engine():
    """A Docker SDK client of an engine that answers: the one running, else a dockerd started here (as root)
    and stopped at the end of the session. Skips when neither is possible.

    dockerd changes the host's network (FORWARD policy DROP, its DOCKER chains and rules, docker0,
    ip_forward) and leaves it so when it stops: the one started here has that taken back when it
    stops (tests/dockerd_host.py). The netns runtime's tests pass with the engine up, since their
    forwarding happens inside their own namespaces, whose iptables are their own."""
    if _Engine.client is None:
        try:
            _start_engine()
        except RuntimeError as exc:
            pytest.fail(str(exc))
    if _Engine.client is None:
        pytest.skip(_Engine.skip or "no Docker engine")
    return _Engine.client


@pytest.fixture(scope="session")
def docker_images(docker_engine):
    """The images of the docker runtime, built once (early, when the docker tests were collected as root)."""
    from neuronabox.cluster import images

    if _Engine.build is not None:
        return _Engine.build.result()
    return images.build(client=docker_engine, progress=lambda m: print(m, file=sys.stderr))
