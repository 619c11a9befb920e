"""How fast the flow model answers on a 1024-rank fat-tree (1024 nodes x 1 rank, 100Gbps).

Target: a cold all-reduce estimate over 1024 ranks (graph built, routes not yet computed) in
under 1 s on the 2-core developer machine; warm estimates hit the memo. Also measured: four
concurrent all-reduces over groups of 256 (strided, so their rings share the uplinks; and
contiguous blocks, one per quarter of the tree), cold; the slowdown is the slowest concurrent
duration over the slowest alone. Run: `.venv/bin/python benchmarks/flow_speed.py`.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

from neuronabox.collectives import Op
from neuronabox.model.base import Collective, Group
from neuronabox.model.flow import FlowModel
from neuronabox.topology import parse_topology
from neuronabox.topology.graph import ClusterGraph

ROOT = Path(__file__).resolve().parent.parent
TOPOLOGY = (
    "cluster: {{nodes: {nodes}}}\n"
    "network: {{type: fat-tree, link: {{bandwidth: 100Gbps, latency: 1us}}, fat_tree: {{oversubscription: {over}}}}}\n"
)


def timed(fn):
    """(seconds, result) of one call."""
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def measure(nodes: int, over: float, size: int, warm_calls: int, alltoall: bool) -> dict:
    """One oversubscription: graph build, cold/warm estimates, concurrent groups."""
    topo = parse_topology(TOPOLOGY.format(nodes=nodes, over=over), f"fat-tree-{nodes}-over{over}")
    build_s, graph = timed(lambda: ClusterGraph(topo))
    model = FlowModel(topo, graph)
    world = Group(range(nodes))
    cold_s, est = timed(lambda: model.estimate(Op.ALL_REDUCE, size, world))
    sizes = [8 << (i % 28) for i in range(warm_calls)]
    warm = []
    for s in sizes:
        t, _ = timed(lambda s=s: model.estimate(Op.ALL_REDUCE, s, world))
        warm.append(t)
    quarter = nodes // 4
    row = {
        "nodes": nodes,
        "oversubscription": over,
        "bytes": size,
        "graph_build_s": build_s,
        "cold_s": cold_s,
        "warm_median_s": statistics.median(warm),
        "warm_max_s": max(warm),
        "all_reduce_s": est.duration,
    }
    for name, groups in (
        ("strided", [Group(range(i, nodes, 4)) for i in range(4)]),
        ("blocks", [Group(range(i * quarter, (i + 1) * quarter)) for i in range(4)]),
    ):
        cs = [Collective(Op.ALL_REDUCE, size // 4, g) for g in groups]
        # A fresh model: its phase patterns are cold (the graph keeps the routes it has computed).
        fresh = FlowModel(topo, graph)
        conc_s, out = timed(lambda cs=cs: fresh.estimate_concurrent(cs))
        alone = max(fresh.estimate(c.op, c.nbytes, c.group).duration for c in cs)
        row[f"concurrent_{name}_s"] = conc_s
        row[f"concurrent_{name}_slowdown"] = max(e.duration for e in out) / alone
    if alltoall:
        a2a_s, a2a = timed(lambda: model.estimate(Op.ALL_TO_ALL, size, world))
        row["all_to_all_cold_s"] = a2a_s
        row["all_to_all_s"] = a2a.duration
    return row


def main() -> None:
    """Measure, print the table and write JSON to benchmarks/results/flow_speed.json."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--nodes", type=int, default=1024)
    ap.add_argument("--bytes", type=int, default=1 << 28, help="all-reduce size (each concurrent group gets 1/4)")
    ap.add_argument("--warm-calls", type=int, default=2000)
    ap.add_argument("--alltoall", action="store_true", help="also time a cold direct all-to-all (tens of seconds)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/flow_speed.json"))
    args = ap.parse_args()
    rows = [measure(args.nodes, over, args.bytes, args.warm_calls, args.alltoall) for over in (1, 4)]
    print(
        f"{'over':>4s} {'graph s':>8s} {'cold s':>8s} {'warm us':>8s} {'AR ms':>9s} "
        f"{'4x256 strided s':>16s} {'slowdown':>9s} {'4x256 blocks s':>15s} {'slowdown':>9s}"
    )
    for r in rows:
        print(
            f"{r['oversubscription']:>4g} {r['graph_build_s']:8.3f} {r['cold_s']:8.3f} {r['warm_median_s'] * 1e6:8.1f} "
            f"{r['all_reduce_s'] * 1e3:9.2f} {r['concurrent_strided_s']:16.3f} {r['concurrent_strided_slowdown']:9.2f} "
            f"{r['concurrent_blocks_s']:15.3f} {r['concurrent_blocks_slowdown']:9.2f}"
        )
        if "all_to_all_cold_s" in r:
            print(f"     all-to-all direct: cold {r['all_to_all_cold_s']:.1f} s, modeled {r['all_to_all_s'] * 1e3:.2f} ms")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"python": platform.python_version(), "machine": platform.machine(), "processor": platform.processor()}
    out.write_text(json.dumps({"benchmark": "flow_speed", "meta": meta, "rows": rows}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
