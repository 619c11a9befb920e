"""The launcher under faults (issue 31): a kill -9 of ``nbox run`` leaves no process of the run within
2 s (one real rank, model and wire mode; several, through torch's elastic agent), the next run removes
its temporary folders, and ``nbox down`` during ``nbox up`` of the same name waits instead of racing."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from neuronabox.runfiles import owned_tempdir, remove_abandoned

from .conftest import ROOT, private_cluster_state

SPIN = "import os, sys\nopen(os.path.join(sys.argv[1], str(os.getpid())), 'w').close()\nwhile True:\n    pass\n"
TOPO = ("name: orph\ncluster: {nodes: 2, ranks_per_node: 2}\nintra_node: {fabric: shm}\n"
        "network: {type: switch, link: {bandwidth: 1Gbps}}\nemulation: {library: gloo}\n")


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE  # dead, waiting for init to reap it
    except psutil.NoSuchProcess:
        return True


def _kill_9_mid_run(tmp_path: Path, flags: list[str], ranks: int, env: dict | None = None) -> tuple[list[int], Path]:
    """Start nbox run with a script that spins forever, kill -9 nbox once every rank runs; the ranks' pids and TMPDIR."""
    pids, tmp = tmp_path / "pids", tmp_path / "tmp"
    pids.mkdir()
    tmp.mkdir()
    (tmp_path / "spin.py").write_text(SPIN)
    (tmp_path / "t.yaml").write_text(TOPO)
    env = {**os.environ, "TMPDIR": str(tmp), **(env or {})}
    proc = subprocess.Popen([sys.executable, "-m", "neuronabox.cli", "run", str(tmp_path / "t.yaml"), *flags, "--",
                             sys.executable, str(tmp_path / "spin.py"), str(pids)], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while len(list(pids.iterdir())) < ranks:
        assert proc.poll() is None, proc.stderr.read()
        assert time.monotonic() < deadline
        time.sleep(0.1)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    killed = time.monotonic()
    ranks_pids = [int(p.name) for p in pids.iterdir()]
    while not all(_gone(p) for p in ranks_pids) and time.monotonic() - killed < 2:
        time.sleep(0.05)
    return ranks_pids, tmp


def _no_orphans_and_next_run_cleans(tmp_path: Path, flags: list[str], ranks: int, env: dict | None = None) -> None:
    pids, tmp = _kill_9_mid_run(tmp_path, flags, ranks, env)
    left = [p for p in pids if not _gone(p)]
    for p in left:  # not to leave them spinning if the test fails
        os.kill(p, signal.SIGKILL)
    assert not left, f"ranks still running 2 s after kill -9 of nbox run: {left}"
    assert {p.name.rsplit("-", 1)[0] for p in tmp.iterdir()} == {"nbox-run", "nbox-progress"}
    r = subprocess.run([sys.executable, "-m", "neuronabox.cli", "run", "-q", str(tmp_path / "t.yaml"), "--",
                        sys.executable, "-c", "pass"], cwd=ROOT, env={**os.environ, "TMPDIR": str(tmp)},
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert list(tmp.iterdir()) == []


def test_kill_9_of_nbox_run_one_real_rank(tmp_path):
    _no_orphans_and_next_run_cleans(tmp_path, [], 1)


def test_kill_9_of_nbox_run_elastic_workers(tmp_path):
    _no_orphans_and_next_run_cleans(tmp_path, ["--nproc-per-node", "2"], 2)


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (network namespaces)")
def test_kill_9_of_nbox_run_wire_mode_and_down_waits_for_up(tmp_path_factory, tmp_path):
    from neuronabox.cluster import runtime as rt
    from neuronabox.cluster.namespace import list_namespaces
    from neuronabox.cluster.state import ClusterState

    gen = private_cluster_state(tmp_path_factory, "nbox-orph")
    state = next(gen)
    try:
        (tmp_path / "up.yaml").write_text(TOPO.replace("nodes: 2", "nodes: 16").replace("1Gbps}", "1Gbps, latency: 1ms}"))
        up = subprocess.Popen([sys.executable, "-m", "neuronabox.cli", "up", str(tmp_path / "up.yaml"), "--runtime", "netns"],
                              cwd=ROOT, env={**os.environ, "NBOX_STATE_DIR": str(state)},
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 30
        while not ClusterState.exists("orph"):
            assert up.poll() is None and time.monotonic() < deadline, up.stderr.read()
            time.sleep(0.02)
        # Halfway through `up`: down waits for it (it once pulled the namespaces from under it:
        # FileNotFoundError '/run/netns/nbx-...'), then removes the whole cluster.
        r = subprocess.run([sys.executable, "-m", "neuronabox.cli", "down", "orph"], cwd=ROOT,
                           env={**os.environ, "NBOX_STATE_DIR": str(state)}, capture_output=True, text=True, timeout=60)
        assert up.wait(60) == 0, up.stderr.read()
        assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
        assert "is busy (`nbox up` pid" in r.stdout and "removed 17 namespaces" in r.stdout, r.stdout
        assert not ClusterState.exists("orph") and not [n for n in list_namespaces() if n.startswith("nbx-orph-")]

        rt.up(tmp_path / "up.yaml", runtime="netns", name="orph")
        wire = tmp_path / "wire"
        wire.mkdir()
        _no_orphans_and_next_run_cleans(wire, ["--cluster", "orph", "--mode", "wire"], 1)
    finally:
        for _ in gen:
            pass


def test_remove_abandoned_takes_a_dead_owner_s_folder_only(tmp_path):
    code = ("import sys, time; sys.path.insert(0, sys.argv[1]); from neuronabox.runfiles import owned_tempdir\n"
            "with owned_tempdir('nbox-t-') as d:\n    print(d, flush=True); time.sleep(60)\n")
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    live = subprocess.Popen([sys.executable, "-c", code, str(ROOT)], env=env, stdout=subprocess.PIPE, text=True)
    dead = subprocess.Popen([sys.executable, "-c", code, str(ROOT)], env=env, stdout=subprocess.PIPE, text=True)
    try:
        live_dir, dead_dir = Path(live.stdout.readline().strip()), Path(dead.stdout.readline().strip())
        dead.kill()
        dead.wait()
        foreign = tmp_path / "nbox-t-foreign"  # no owner file: an older nbox's, or not ours at all
        foreign.mkdir()
        assert remove_abandoned("nbox-t-", str(tmp_path)) == [dead_dir]
        assert live_dir.is_dir() and foreign.is_dir() and not dead_dir.exists()
    finally:
        live.kill()
        live.wait()
    with owned_tempdir("nbox-u-") as d:
        assert Path(d, ".owner").is_file()
    assert not Path(d).exists()
