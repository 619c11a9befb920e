"""nbox up/down cost and the user-space delay relay's throughput (root only).

- up and down wall time, and peak memory (the `up` process's peak RSS plus the shaping
  agent's RSS), for 16 and 64 nodes on a switch and on a fat-tree. Goal for 64 nodes:
  under 5 s and under 200 MB.
- relay throughput: one TCP stream between two nodes whose link adds 1 ms each way, through
  the agent's relay. Goal: at least 1 Gbit/s.
- NFQUEUE delay line (ICMP/UDP): ping RTT against the set delay, and how many UDP datagrams
  per second it delays (one Python verdict each: meant for control traffic, not bulk data).

Writes benchmarks/results/cluster_updown.json. Every address used lies inside the
namespaces this script makes.
"""

from __future__ import annotations

import atexit
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "results" / "cluster_updown.json"

CHILD = r"""
import json, os, sys, time, psutil
from neuronabox.cluster import runtime as rt
from neuronabox.cluster.state import ClusterState
from neuronabox.topology import parse_topology
kind, n = sys.argv[1], int(sys.argv[2])
text = f"cluster: {{nodes: {n}}}\nnetwork: {{type: {kind}, link: {{bandwidth: 10Gbps, latency: 20us}}}}\n"
t = parse_topology(text, f"{kind}-{n}.yaml")
t0 = time.perf_counter()
res = rt.up(t, runtime="netns", name="bench")
up_s = time.perf_counter() - t0
st = ClusterState.load("bench")
agent_pid = next(p["pid"] for p in st["processes"] if p["role"] == "agent")
agent_rss = psutil.Process(agent_pid).memory_info().rss
plan = st["plan"]
t0 = time.perf_counter()
rt.down("bench")
down_s = time.perf_counter() - t0
print(json.dumps({"up_s": up_s, "down_s": down_s, "agent_rss": agent_rss, "links": len(plan["links"]),
                  "namespaces": len(st["namespaces"])}))
"""


def updown(kind: str, n: int) -> dict:
    """One up/down cycle in a child process; its peak RSS comes from wait4."""
    proc = subprocess.Popen([sys.executable, "-c", CHILD, kind, str(n)], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"up/down of {kind} {n} failed")
    r = json.loads(out.strip().splitlines()[-1])
    r.update(kind=kind, nodes=n, up_peak_rss=usage.ru_maxrss * 1024)
    r["memory_mb"] = (r["up_peak_rss"] + r["agent_rss"]) / 2**20
    return r


def relay_throughput(delay: str = "1ms", seconds: float = 3.0) -> dict:
    """TCP goodput from node0 to node1 through the relay that adds ``delay`` each way."""
    from neuronabox.cluster import runtime as rt
    from neuronabox.cluster.namespace import Namespace
    from neuronabox.topology import parse_topology

    t = parse_topology(f"cluster: {{nodes: 2}}\nnetwork: {{type: switch, link: {{bandwidth: 25Gbps, latency: {delay}}}}}\n", "r.yaml")
    # The link's one-way delay is split over the two links of the route (node -> switch -> node).
    res = rt.up(t, runtime="netns", name="relaybench", shape=True)
    try:
        a, b = res.nodes
        mech = res.links[0]["mechanisms"]
        srv = Namespace(b["ns"]).socket(socket.AF_INET, socket.SOCK_STREAM)
        srv.bind((b["address"], 0))
        srv.listen(1)
        got: dict = {}

        def rx() -> None:
            c, _ = srv.accept()
            buf = bytearray(1 << 20)
            n, t0 = 0, None
            while True:
                k = c.recv_into(buf)
                if not k:
                    break
                if t0 is None:
                    t0 = time.perf_counter()
                n += k
            got.update(n=n, s=time.perf_counter() - t0)
            c.close()

        th = threading.Thread(target=rx)
        th.start()
        c = Namespace(a["ns"]).socket(socket.AF_INET, socket.SOCK_STREAM)
        c.connect((b["address"], srv.getsockname()[1]))
        chunk = b"\0" * (1 << 20)
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            c.sendall(chunk)
        c.close()
        th.join()
        srv.close()
        return {"delay_per_link": delay, "route_one_way_delay_s": 2 * float(delay.rstrip("ms")) / 1e3,
                "mechanism": mech, "bytes": got["n"], "seconds": got["s"], "gbit_per_s": got["n"] * 8 / got["s"] / 1e9}
    finally:
        rt.down("relaybench")


def queue_figures(delay: str = "0.5ms", seconds: float = 2.0, size: int = 1400) -> dict:
    """Ping RTT through the NFQUEUE delay line, and its UDP rate (datagrams of ``size`` bytes sent flat out)."""
    import re

    from neuronabox.cluster import runtime as rt
    from neuronabox.cluster.namespace import Namespace
    from neuronabox.topology import parse_topology

    t = parse_topology(f"cluster: {{nodes: 2}}\nnetwork: {{type: switch, link: {{bandwidth: 25Gbps, latency: {delay}}}}}\n", "q.yaml")
    res = rt.up(t, runtime="netns", name="queuebench", shape=True)
    try:
        a, b = res.nodes
        out = subprocess.run(["ping", "-n", "-c", "100", "-i", "0.01", b["address"]], capture_output=True, text=True,
                             preexec_fn=Namespace(a["ns"]).preexec()).stdout
        rtts = sorted(float(x) / 1e3 for x in re.findall(r"time=([\d.]+) ms", out))
        rx = Namespace(b["ns"]).socket(socket.AF_INET, socket.SOCK_DGRAM)
        rx.setsockopt(socket.SOL_SOCKET, 33, 64 << 20)  # SO_RCVBUFFORCE: the receiver is not the bottleneck
        rx.bind((b["address"], 0))
        rx.settimeout(1.0)
        got = {"n": 0, "first": None, "last": None}

        def drain() -> None:
            try:
                while True:
                    rx.recv(65536)
                    now = time.perf_counter()
                    got["first"] = got["first"] or now
                    got["last"] = now
                    got["n"] += 1
            except socket.timeout:
                pass

        th = threading.Thread(target=drain)
        th.start()
        tx = Namespace(a["ns"]).socket(socket.AF_INET, socket.SOCK_DGRAM)
        payload = b"\0" * size
        sent, end = 0, time.perf_counter() + seconds
        while time.perf_counter() < end:
            try:
                tx.sendto(payload, rx.getsockname())
                sent += 1
            except OSError:
                pass
        th.join()
        tx.close()
        rx.close()
        span = max((got["last"] or 0) - (got["first"] or 0), 1e-9)
        return {"delay_per_link": delay, "route_one_way_delay_s": 2 * float(delay.rstrip("ms")) / 1e3,
                "mechanism": res.links[0]["mechanisms"], "ping_rtt_median_s": rtts[len(rtts) // 2], "ping_rtt_min_s": rtts[0],
                "udp_datagram_bytes": size, "udp_sent": sent, "udp_received": got["n"],
                "udp_packets_per_s": got["n"] / span, "udp_mbyte_per_s": got["n"] * size / span / 1e6}
    finally:
        rt.down("queuebench")


def main() -> int:
    """Run every measurement and write the JSON."""
    if os.geteuid() != 0:
        print("cluster_updown: needs root (network namespaces)", file=sys.stderr)
        return 2
    if "NBOX_STATE_DIR" not in os.environ:
        # A private state directory, removed at exit (each run used to leave an empty one in /tmp).
        state = tempfile.TemporaryDirectory(prefix="nbox-bench-")
        atexit.register(state.cleanup)
        os.environ["NBOX_STATE_DIR"] = state.name
    runs = []
    for kind in ("switch", "fat-tree"):
        for n in (16, 64):
            r = updown(kind, n)
            runs.append(r)
            print(f"{kind:8s} {n:3d} nodes ({r['namespaces']} namespaces, {r['links']} links): up {r['up_s']:.2f} s, "
                  f"down {r['down_s']:.2f} s, memory {r['memory_mb']:.0f} MB (up {r['up_peak_rss'] / 2**20:.0f} + agent {r['agent_rss'] / 2**20:.0f})")
    relay = [relay_throughput("0.5ms"), relay_throughput("0.5ms")]
    for r in relay:
        print(f"relay, {r['route_one_way_delay_s'] * 1e3:g} ms added each way: {r['gbit_per_s']:.2f} Gbit/s")
    queue = queue_figures()
    print(f"nfqueue, {queue['route_one_way_delay_s'] * 1e3:g} ms added each way: ping RTT median "
          f"{queue['ping_rtt_median_s'] * 1e3:.3f} ms; UDP {queue['udp_packets_per_s']:.0f} datagrams/s "
          f"({queue['udp_mbyte_per_s']:.1f} MB/s), {queue['udp_received']}/{queue['udp_sent']} arrived")
    worst64 = max((r for r in runs if r["nodes"] == 64), key=lambda r: r["up_s"] + r["down_s"])
    doc = {
        "benchmark": "cluster_updown",
        "host": {"cpus": os.cpu_count(), "kernel": platform.release(), "python": platform.python_version()},
        "updown": runs,
        "relay": relay,
        "nfqueue": queue,
        "goals": {
            "updown_64_under_5s": max(worst64["up_s"], worst64["down_s"]) < 5.0,
            "memory_64_under_200mb": max(r["memory_mb"] for r in runs if r["nodes"] == 64) < 200,
            "relay_1ms_at_least_1gbit": min(r["gbit_per_s"] for r in relay) >= 1.0,
        },
    }
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
