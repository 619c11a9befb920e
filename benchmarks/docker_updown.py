"""The docker runtime against a real engine: up/down time, a stub's memory, ping and TCP on a shaped link.

- images: ``nbox images build`` (all three); the time says whether they were cached.
- up/down: a 16-node switch cluster (``--runtime docker``), images cached, ``--repeats`` times.
  Goals: up < 10 s, down < 5 s.
- stub memory: resident set of one peer container's processes with its stub serving (the stub starts on first
  use, as a wire run starts it), and of the container at rest (from the host, psutil). Goal <= 30 MB.
- link: ping RTT node0 -> node1 and TCP goodput over 100 Mbit/s links (tbf on the veths in the containers),
  against the payload rate as the netns tests count it (within 5 %).

Needs root and an engine that answers (dockerd). Writes benchmarks/results/docker_updown.json,
with the command that made it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "results" / "docker_updown.json"
PORTS = {"agent_port": 29465, "prometheus_port": 29090, "metrics_port": 29464}


def topo(n: int, bw: str):
    from neuronabox.topology import parse_topology

    return parse_topology(f"cluster: {{nodes: {n}}}\nnetwork: {{type: switch, link: {{bandwidth: {bw}, latency: 0us}}}}\n",
                          f"switch-{n}.yaml")


def stub_rss(client, cluster: str, node: str) -> tuple[int, int]:
    """Resident bytes of ``node``'s peer container at rest, and with its stub serving (started as a wire run would)."""
    import psutil

    from neuronabox.cluster.stub import ensure_stub

    pid = client.containers.get(f"nbox-{cluster}-{node}").attrs["State"]["Pid"]
    procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    idle = sum(p.memory_info().rss for p in procs)
    # The stub starts on first use, as a process in the container's namespaces.
    stub = psutil.Process(ensure_stub(cluster, node)["pid"])
    serving = {p.pid: p for p in (*procs, stub, *stub.children(recursive=True))}
    return idle, sum(p.memory_info().rss for p in serving.values())


def link(client, res) -> dict:
    """Ping RTT and TCP goodput node0 -> node1."""
    from neuronabox.cluster.goodput_probe import TCP_PAYLOAD_SHARE, container_goodput

    a, b = (f"nbox-{res.name}-node{i}" for i in (0, 1))
    dst = res.nodes[1]["address"]
    ping = client.containers.get(a).exec_run(["ping", "-c", "20", "-i", "0.05", "-q", dst]).output.decode()
    rtt = [float(x) for x in ping.rsplit("=", 1)[1].split()[0].split("/")]
    rate = 100e6 / 8
    got = container_goodput(client, a, b, dst, int(rate * 3))
    return {"ping_rtt_ms": {"min": rtt[0], "avg": rtt[1], "max": rtt[2]}, "rate_bit_per_s": rate * 8,
            "tcp_goodput_bit_per_s": got * 8, "error_vs_payload_rate": got / (rate * TCP_PAYLOAD_SHARE) - 1}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    os.environ.setdefault("NBOX_STATE_DIR", "/run/neuronabox-bench-docker")
    from neuronabox.cluster import docker_runtime as dr
    from neuronabox.cluster import images

    client = dr.client()
    t0 = time.perf_counter()
    built = images.build(client=client)
    build = {"seconds": time.perf_counter() - t0, "images": [{"ref": b.ref, "cached": b.cached, "mb": b.size / 1e6}
                                                              for b in built]}
    runs = []
    for i in range(args.repeats):
        t0 = time.perf_counter()
        res = dr.up(topo(args.nodes, "10Gbps"), name="dbench", **PORTS)
        up_s = time.perf_counter() - t0
        rss = stub_rss(client, "dbench", "node1") if i == 0 else None
        t0 = time.perf_counter()
        dr.down("dbench")
        runs.append({"up_s": up_s, "down_s": time.perf_counter() - t0,
                     **({"stub_rss_mb": rss[1] / 2**20, "stub_container_idle_rss_mb": rss[0] / 2**20} if rss else {})})
        print(runs[-1], file=sys.stderr)
    res = dr.up(topo(2, "100Mbps"), name="dlink", **PORTS)
    try:
        shaped = link(client, res)
    finally:
        dr.down("dlink")
    out = {
        "benchmark": "docker_updown",
        "command": "sudo .venv/bin/python benchmarks/docker_updown.py " + " ".join(sys.argv[1:]),
        "host": {"cpus": os.cpu_count(), "kernel": platform.release(), "python": platform.python_version(),
                 "engine": client.version().get("Version"),
                 # This host is shared: its load during the run says how much the times mean.
                 "load_average_1_5_15": list(os.getloadavg())},
        "images": build,
        "nodes": args.nodes,
        "updown": runs,
        "up_s_median": statistics.median(r["up_s"] for r in runs),
        "down_s_median": statistics.median(r["down_s"] for r in runs),
        "stub_rss_mb": runs[0]["stub_rss_mb"],  # the peer container with its stub serving
        "stub_container_idle_rss_mb": runs[0]["stub_container_idle_rss_mb"],  # before the first wire run
        "link_100mbit": shaped,
        "goals": {"up_s": 10, "down_s": 5, "stub_rss_mb": 30, "throughput_error": 0.05},
    }
    OUT.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps({k: out[k] for k in ("up_s_median", "down_s_median", "stub_rss_mb")}), shaped)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
