"""The cluster's pure parts: plan, names, addresses, state file, tc numbers, API parsing (no root needed)."""

from __future__ import annotations

import ipaddress
import json
import os
import subprocess
import sys

import pytest

from neuronabox.cluster.agent import parse_shape_changes
from neuronabox.cluster.netplan import plan_network
from neuronabox.cluster.shaping import GSO_MAX_SIZE, LinkShape, loss_rules, mechanisms, rate_params
from neuronabox.cluster.state import ClusterState, default_name, list_clusters, valid_name
from neuronabox.errors import InputError
from neuronabox.topology.graph import ClusterGraph

from .conftest import ROOT, topo


def fat_tree(n: int, extra: str = ""):
    return topo(f"cluster: {{nodes: {n}}}\nnetwork: {{type: fat-tree, link: {{bandwidth: 1Gbps, latency: 10us}}{extra}}}\n")


def switch(n: int, latency: str = "10us"):
    return topo(f"cluster: {{nodes: {n}}}\nnetwork: {{type: switch, link: {{bandwidth: 1Gbps, latency: {latency}}}}}\n")


@pytest.fixture
def state_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("NBOX_STATE_DIR", str(tmp_path / "state"))
    return tmp_path / "state"


@pytest.mark.parametrize("t", [switch(4), switch(64), fat_tree(16), fat_tree(64),
                               topo("cluster: {nodes: 6}\nnetwork: {type: ring, link: {bandwidth: 1Gbps}}\n"),
                               topo((ROOT / "topologies" / "dgx-h100-32.yaml").read_text())])
def test_plan_names_and_addresses_are_unique_and_short(t):
    plan = plan_network(t, "c1")
    names = [p.name for p in plan.namespaces]
    assert len(names) == len(set(names))
    net = ipaddress.IPv4Network(plan.subnet)
    per_ns: dict[str, set[str]] = {}
    addrs = [p.address for p in plan.namespaces if p.address]
    for lk in plan.links:
        for e in (lk.a, lk.b):
            assert len(e.ifname) <= 15
            assert e.ifname not in per_ns.setdefault(e.ns, set())
            per_ns[e.ns].add(e.ifname)
            if e.addr:
                addrs.append(e.addr)
    assert len(addrs) == len(set(addrs))
    assert all(ipaddress.IPv4Address(a) in net for a in addrs)
    assert plan.node_addr["node0"] == "10.77.0.1"
    # Every ordered node pair has a route.
    n = len(t.nodes)
    assert len(plan.pair_links) == n * (n - 1)


def test_two_clusters_never_share_a_namespace_name():
    a = {p.name for p in plan_network(switch(4), "a").namespaces}
    ab = {p.name for p in plan_network(switch(4), "a_b").namespaces}
    b = {p.name for p in plan_network(switch(4), "b").namespaces}
    assert not (a & ab) and not (a & b) and not (ab & b)
    with pytest.raises(InputError):
        valid_name("a-b")  # '-' separates name and node in namespace names
    with pytest.raises(InputError):
        valid_name("x" * 25)
    assert default_name("cpu-8x1g") == "cpu_8x1g"


def test_plan_routes_follow_the_topology_route():
    t = fat_tree(16)
    plan = plan_network(t, "c")
    g = ClusterGraph(t)
    for (a, b), hops in plan.pair_links.items():
        na = next(n for n in t.nodes if n.name == a)
        nb = next(n for n in t.nodes if n.name == b)
        verts = [v for v in g.route_vertices(na.first_rank, nb.first_rank) if g.g.nodes[v]["kind"] in ("nic", "switch")]
        names = [plan.links[lid].name for lid, _ in hops]
        assert len(names) == len(verts) - 1
        for (u, v), (lid, d) in zip(zip(verts, verts[1:]), hops):
            lk = plan.links[lid]
            ends = (lk.a.vertex, lk.b.vertex) if d == 0 else (lk.b.vertex, lk.a.vertex)
            assert ends == (u, v)


def test_ecmp_by_pair_needs_per_source_rules():
    plan = plan_network(fat_tree(16), "c")
    # Pairs across pods take different cores by hash: some switch must route by source.
    assert sum(len(r) for r in plan.rules.values()) > 0
    assert plan.route_count() > 16 * 15


def test_subnet_too_small_is_an_input_error():
    with pytest.raises(InputError, match="too small"):
        plan_network(switch(64), "c", "10.9.0.0/26")
    with pytest.raises(InputError, match="--subnet"):
        plan_network(switch(4), "c", "not-a-net")


def test_state_file_is_written_whole_and_reloaded(state_dir):
    st = ClusterState("s1")
    st.set(phase="creating")
    st.record("namespaces", [{"name": "nbx-s1-h0"}])
    st.record("processes", {"role": "agent", "token": "tok"})
    st.update_process("tok", pid=123)
    again = ClusterState.load("s1")
    assert again["namespaces"] == [{"name": "nbx-s1-h0"}]
    assert again["processes"][0]["pid"] == 123
    assert not list(st.dir.glob(".state.*.tmp"))
    assert list_clusters() == ["s1"]
    json.loads(st.path.read_text())
    st.remove_files()
    assert list_clusters() == []
    with pytest.raises(InputError, match="no cluster"):
        ClusterState.load("s1")


@pytest.mark.parametrize("mbit", [1, 10, 100, 1000, 10000])
def test_rate_params_are_sane(mbit):
    p = rate_params(mbit * 1e6 / 8)
    assert p.burst >= 2 * 1514
    assert p.burst <= max(2 * 1514, p.rate * 0.0011)
    # A GSO packet (payload <= gso_max_size, plus 66 B per 1448 B segment) fits the bucket: tbf never cuts it.
    assert p.gso_max_size * 1514 / 1448 <= p.burst and p.gso_max_size <= GSO_MAX_SIZE
    assert (p.gso_max_size == GSO_MAX_SIZE) == (mbit >= 1000)  # from ~600 Mbit/s a 1 ms bucket holds 64 KiB
    assert p.limit > p.burst
    # The queue holds no more than ~20 ms of traffic (plus ten frames at low rates).
    assert (p.limit - p.burst) / p.rate <= max(0.021, 10 * 1514 / p.rate + 1e-9)


def test_mechanisms_and_loss_rules_without_netem():
    s = [LinkShape(1.25e8, 0.001, 0, 0.01), LinkShape(1.25e8, 0.001, 0, 0)]
    m = mechanisms(s, netem=False)
    assert m == {"rate": "tbf", "delay": "relay (TCP) + nfqueue (ICMP/UDP)", "loss": "iptables statistic"}
    assert mechanisms(s, netem=True)["delay"] == "netem"
    assert mechanisms([LinkShape(10e9), LinkShape(10e9)], netem=False)["rate"] == "htb"
    lk = plan_network(switch(2), "c").links[0]
    rules = loss_rules(lk, 0.01, 0.02)
    # The switch end is a bridge port, invisible to iptables: both directions drop at the NIC.
    assert set(rules) == {lk.a.ns}
    assert len(rules[lk.a.ns]) == 2


def test_delay_rules_send_tcp_to_the_relay_and_the_rest_to_the_queue():
    from neuronabox.cluster.nfqueue import QUEUE_NUM, flow_key
    from neuronabox.cluster.shaping import delay_rules

    tcp, rest = delay_rules(15001, "10.77.0.0/16")
    assert tcp[tcp.index("-j") + 1] == "REDIRECT" and "tcp" in tcp
    assert rest[:4] == ["-t", "mangle", "-A", "OUTPUT"] and rest[rest.index("-j") + 1] == "NFQUEUE"
    assert rest[rest.index("-p") - 1] == "!" and str(QUEUE_NUM) in rest and "--queue-bypass" in rest
    # Flow keys: ICMP echoes by id, UDP by ports; two pings with different ids are different flows.
    ip = bytes([0x45, 0, 0, 84, 0, 0, 0, 0, 64, 1, 0, 0, 10, 77, 0, 1, 10, 77, 0, 2])
    echo = lambda ident, seq: ip + bytes([8, 0, 0, 0]) + ident.to_bytes(2, "big") + seq.to_bytes(2, "big")
    assert flow_key(echo(7, 1)) == flow_key(echo(7, 2)) != flow_key(echo(8, 1))
    udp = ip[:9] + bytes([17]) + ip[10:] + bytes([0x13, 0x88, 0x27, 0x10, 0, 8, 0, 0])
    assert flow_key(udp) == (17, bytes([10, 77, 0, 2]), bytes([0x13, 0x88, 0x27, 0x10]))


def test_parse_shape_changes():
    got = parse_shape_changes({"rate": "100Mbps", "delay": "2ms", "jitter": "100us", "loss": "0.1%"})
    assert got == pytest.approx({"rate": 12.5e6, "delay": 0.002, "jitter": 0.0001, "loss": 0.001})
    assert parse_shape_changes({"rate": 1e6, "direction": "ab"}) == {"rate": 1e6}
    assert parse_shape_changes({"rate": "0"}) == {"rate": 0.0}
    for bad in ({"rate": "fast"}, {"speed": 1}, {"loss": 2}, {"delay": -1}):
        with pytest.raises(InputError):
            parse_shape_changes(bad)


def test_docker_runtime_without_engine_is_a_clear_input_error(state_dir, monkeypatch):
    from neuronabox.cluster.runtime import up

    monkeypatch.setenv("DOCKER_HOST", f"unix://{state_dir}/no-docker.sock")
    with pytest.raises(InputError, match="no Docker engine answers"):
        up(switch(2), runtime="docker", name="d1")
    assert not ClusterState.exists("d1")


def test_auto_without_root_falls_back_to_local(tmp_path):
    # Drop every capability (capset with empty sets): what an ordinary user has.
    code = (
        "import ctypes, struct\n"
        "hdr = ctypes.create_string_buffer(struct.pack('=Ii', 0x20080522, 0))\n"
        "data = ctypes.create_string_buffer(24)\n"
        "assert ctypes.CDLL(None, use_errno=True).syscall(126, hdr, data) == 0\n"
        "from neuronabox.cluster.runtime import up, down, exec_in\n"
        "from neuronabox.topology import parse_topology\n"
        "t = parse_topology('cluster: {nodes: 3}\\nnetwork: {type: switch, link: {bandwidth: 1Gbps}}\\n', 'x.yaml')\n"
        "r = up(t, runtime='auto', name='loc')\n"
        "print(r.runtime, r.notes[0])\n"
        "p = exec_in('loc', 'node2', ['python3', '-c', 'import os; print(os.environ[\"NBOX_NODE_ADDR\"])'], capture_output=True, text=True)\n"
        "print(p.stdout.strip())\n"
        "print(up(t, runtime='auto', name='loc').already_up)\n"
        "down('loc')\n"
    )
    d = tmp_path / "st"
    d.mkdir()
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                       env={**os.environ, "NBOX_STATE_DIR": str(d)}, timeout=60)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("local runtime auto: falling back to local (needs root or CAP_NET_ADMIN)")
    assert lines[1] == "127.77.0.3"
    assert lines[2] == "True"
    assert not any(d.iterdir())
