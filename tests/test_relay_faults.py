"""Relays and the cluster's other parts under faults (issue 31): a relay cannot be turned on itself,
a node cannot open more than its share of relayed connections, a killed relay is reported and
restarted, and a killed stub or agent is reported by status with the command that fixes it.

Root only: real netns clusters with a delayed route (so the relays run).
"""

from __future__ import annotations

import json
import os
import resource
import signal
import socket
import time
import urllib.error
import urllib.request

import psutil
import pytest

from neuronabox.cluster import runtime as rt
from neuronabox.cluster.namespace import Namespace
from neuronabox.cluster.relay import DEFAULT_PORT, MAX_CONNECTIONS_PER_NODE
from neuronabox.cluster.state import ClusterState

from .conftest import private_cluster_state

pytestmark = [
    pytest.mark.root,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (network namespaces, qdiscs, iptables)"),
]

TOPO = "cluster: {nodes: 2}\nnetwork: {type: switch, link: {bandwidth: 1Gbps, latency: 1ms}}\n"


@pytest.fixture(scope="module", autouse=True)
def state_dir(tmp_path_factory):
    yield from private_cluster_state(tmp_path_factory, "nbox-relayf")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    path = tmp_path_factory.mktemp("topo") / "rf.yaml"
    path.write_text(TOPO)
    rt.up(path, runtime="netns", name="rf")
    yield "rf", path
    rt.down("rf")


def health(name: str) -> tuple[int, dict]:
    url = ClusterState.load(name)["agent"]["url"]
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def hosts(name: str) -> list[dict]:
    return ClusterState.load(name)["plan"]["hosts"]


def relayed_round_trip(name: str) -> float:
    """Seconds for one connect + one byte each way from node0 to node1, through the relays (2 x 1 ms delay)."""
    a, b = hosts(name)
    srv = Namespace(b["ns"]).socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.bind((b["address"], 0))
    srv.listen(4)
    c = Namespace(a["ns"]).socket(socket.AF_INET, socket.SOCK_STREAM)
    c.settimeout(5)
    srv.settimeout(5)
    try:
        t0 = time.perf_counter()
        c.connect((b["address"], srv.getsockname()[1]))
        conn, _ = srv.accept()
        c.sendall(b"x")
        conn.recv(1)
        conn.sendall(b"y")
        c.recv(1)
        took = time.perf_counter() - t0
        conn.close()
        return took
    finally:
        c.close()
        srv.close()


def agent_fds(name: str) -> int:
    agent = next(p for p in ClusterState.load(name)["processes"] if p.get("role") == "agent")
    proc = psutil.Process(agent["pid"])
    return sum(p.num_fds() for p in [proc, *proc.children()])


def test_a_client_dialling_a_relay_port_gets_no_loop(cluster):
    name, _ = cluster
    a, b = hosts(name)
    before_fds = agent_fds(name)
    before = health(name)[1]["relay"]
    c = Namespace(b["ns"]).socket(socket.AF_INET, socket.SOCK_STREAM)
    c.settimeout(3)
    try:
        c.connect((a["address"], DEFAULT_PORT))
        assert c.recv(1) == b""  # closed at once
    except (ConnectionResetError, ConnectionRefusedError):
        pass
    finally:
        c.close()
    time.sleep(1.0)
    after = health(name)[1]["relay"]
    # Once: ~10,000 connections and 20,000 descriptors in 3 s.
    assert after["connections"] - before["connections"] <= 1 and after["refused"] > before["refused"]
    assert agent_fds(name) - before_fds < 10
    assert relayed_round_trip(name) < 1.0  # and the relays still carry other traffic


def test_a_node_has_at_most_its_share_of_relayed_connections(cluster):
    name, _ = cluster
    a, b = hosts(name)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 8192), hard))
    srv = Namespace(b["ns"]).socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.bind((b["address"], 0))
    srv.listen(4096)
    srv.setblocking(False)
    clients, accepted = [], []
    try:
        for _ in range(MAX_CONNECTIONS_PER_NODE + 50):
            c = Namespace(a["ns"]).socket(socket.AF_INET, socket.SOCK_STREAM)
            c.connect((b["address"], srv.getsockname()[1]))  # completes at the local relay
            clients.append(c)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                conn, _ = srv.accept()
                accepted.append(conn)
            except BlockingIOError:
                if len(accepted) >= MAX_CONNECTIONS_PER_NODE:
                    time.sleep(0.5)  # anything over the cap would have arrived by now
                    try:
                        accepted.append(srv.accept()[0])
                    except BlockingIOError:
                        break
                time.sleep(0.01)
        assert len(accepted) == MAX_CONNECTIONS_PER_NODE
    finally:
        for s in clients + accepted + [srv]:
            s.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    time.sleep(0.5)
    assert relayed_round_trip(name) < 1.0  # the closed ones gave their share back


def test_a_killed_relay_is_reported_then_restarted(cluster):
    name, _ = cluster
    code, body = health(name)
    assert code == 200 and body["healthy"]
    restarts = body["relay"]["restarts"]
    victim = body["relay"]["relays"][0]["pid"]
    os.kill(victim, signal.SIGKILL)
    t0 = time.monotonic()
    seen_down = None
    while time.monotonic() - t0 < 2:
        code, body = health(name)
        if code == 503:
            seen_down = seen_down or (body["down"], rt.status(name)[0])
        elif body["relay"]["restarts"] > restarts:
            break
        time.sleep(0.02)
    assert seen_down, "never reported down"
    down, st = seen_down
    assert "delay relay 0" in down[0] and "restarts it" in down[0]
    assert code == 200 and body["healthy"] and body["relay"]["restarts"] == restarts + 1, body
    assert body["relay"]["relays"][0]["pid"] != victim
    assert rt.status(name)[0]["healthy"]
    took = relayed_round_trip(name)
    assert 0.002 <= took < 1.0  # delayed again: the new relay has the delay table


def test_up_waits_for_the_agent_to_restart_a_relay_instead_of_rebuilding(cluster):
    name, path = cluster
    victim = health(name)[1]["relay"]["relays"][-1]["pid"]
    os.kill(victim, signal.SIGKILL)
    t0 = time.monotonic()
    while health(name)[0] != 503 and time.monotonic() - t0 < 1:
        time.sleep(0.01)
    said: list[str] = []
    res = rt.up(path, runtime="netns", name=name, progress=said.append)
    assert res.already_up and rt.status(name)[0]["healthy"], said
    assert health(name)[1]["relay"]["relays"][-1]["pid"] != victim


def test_a_killed_stub_is_reported_then_restarted(cluster):
    name, path = cluster
    stub = next(p for p in ClusterState.load(name)["processes"] if p.get("role") == "stub")
    os.kill(stub["pid"], signal.SIGKILL)
    t0 = time.monotonic()
    while rt.status(name)[0]["healthy"] and time.monotonic() - t0 < 2:
        time.sleep(0.02)
    st = rt.status(name)[0]
    assert not st["healthy"] and st["problem"].startswith(f"the stub of {stub['node']} (pid ")
    assert st["problem"].endswith("is not running; the agent restarts it")
    while not rt.status(name)[0]["healthy"] and time.monotonic() - t0 < 5:
        time.sleep(0.05)
    assert rt.status(name)[0]["healthy"], rt.status(name)
    latest = [p for p in ClusterState.load(name)["processes"] if p.get("role") == "stub" and p.get("node") == stub["node"]][-1]
    assert latest["pid"] != stub["pid"] and psutil.pid_exists(latest["pid"])


def test_a_killed_agent_is_reported_with_the_command_that_fixes_it(cluster):
    name, path = cluster
    agent = next(p for p in ClusterState.load(name)["processes"] if p.get("role") == "agent")
    os.kill(agent["pid"], signal.SIGKILL)
    t0 = time.monotonic()
    while rt.status(name)[0]["healthy"] and time.monotonic() - t0 < 2:
        time.sleep(0.05)
    st = rt.status(name)[0]
    assert st["problem"] == (f"its shaping agent (pid {agent['pid']}) is not running; "
                             f"`nbox up {path} --name {name}` rebuilds it")
    rt.up(path, runtime="netns", name=name)
    assert rt.status(name)[0]["healthy"]
