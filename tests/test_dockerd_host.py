"""The tests' dockerd fixture puts the host's network back: a real dockerd, started and stopped in a network
namespace of its own (so that the host's engine, if any, and the host's iptables are not touched), changes
it as it changes a host, and ``dockerd_host.restore`` leaves it as it was before."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile

import pytest

from .conftest import ROOT

pytestmark = [pytest.mark.root,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root (a dockerd, a network namespace)"),
              pytest.mark.skipif(not (shutil.which("dockerd") and shutil.which("unshare") and shutil.which("iptables")),
                                 reason="needs dockerd, unshare and iptables (make sysdeps)")]

# Run by a Python in a new network namespace: what conftest does around the dockerd it starts.
_IN_NAMESPACE = r"""
import json, os, signal, subprocess, sys, time, urllib.parse
from pathlib import Path
from tests.dockerd_host import differences, restore, snapshot

top = Path(sys.argv[1])
sock = top / "docker.sock"
Path("/proc/sys/net/ipv4/ip_forward").write_text("0")  # a new namespace copies the host's; start from off
before = snapshot()
engine = subprocess.Popen(["dockerd", "--host", f"unix://{sock}", "--data-root", str(top / "data"),
                           "--exec-root", str(top / "exec"), "--pidfile", str(top / "dockerd.pid")],
                          stdout=open(top / "dockerd.log", "w"), stderr=subprocess.STDOUT, start_new_session=True)
deadline = time.monotonic() + 60
host = ["docker", "--host", f"unix://{sock}"]
while subprocess.run([*host, "version"], capture_output=True).returncode != 0:
    assert engine.poll() is None and time.monotonic() < deadline, (top / "dockerd.log").read_text()
    time.sleep(0.2)
# A network of its own as well: its bridge (br-<id>) and its rules.
subprocess.run([*host, "network", "create", "--subnet", "10.233.0.0/24", "nbox-dockerd-host-test"], check=True,
               capture_output=True)
engine.send_signal(signal.SIGTERM)
engine.wait(60)
stopped = snapshot()
undone = restore(before)
print(json.dumps({"changed": differences(before, stopped), "undone": undone,
                  "left": differences(before, snapshot())}))
"""


def test_restore_takes_back_what_a_real_dockerd_changed_in_its_host_network():
    top = tempfile.mkdtemp(prefix="nbox-dockerd-host-")
    try:
        r = subprocess.run(["unshare", "--net", sys.executable, "-c", _IN_NAMESPACE, top], capture_output=True,
                           text=True, cwd=ROOT, timeout=180)
        assert r.returncode == 0, r.stdout + r.stderr
        got = json.loads(r.stdout.strip().splitlines()[-1])
        changed = "\n".join(got["changed"])
        # What dockerd leaves behind when it stops, as on the host.
        for mark in ("link docker0 added", "link br-", "filter: '-P FORWARD DROP' added", "'-N DOCKER' added",
                     "'-N DOCKER-ISOLATION-STAGE-1' added", "nat: '-A POSTROUTING -s 172.17.0.0/16 ! -o docker0 -j MASQUERADE' added",
                     "net/ipv4/ip_forward 0 -> 1"):
            assert mark in changed, changed
        assert got["left"] == [], got
    finally:
        # dockerd unmounts its data root when it stops; a mount left would make rmtree fail loudly.
        shutil.rmtree(top)
