"""How fast the delay models answer: estimates per second on a cached group.

Goal (issue 2): at least 100,000 alpha-beta estimates per second on the 2-core developer
machine. Run: `make bench` or `.venv/bin/python benchmarks/model_speed.py`.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

from neuronabox.collectives import Op
from neuronabox.model.base import Group
from neuronabox.model.registry import create_model
from neuronabox.topology import load_topology

ROOT = Path(__file__).resolve().parent.parent
CASES = [
    ("alpha-beta", "auto", "dgx-h100-32.yaml"),
    ("alpha-beta", "ring", "dgx-h100-32.yaml"),
    ("alpha-beta", "hier-ring", "dgx-h100-32.yaml"),
    ("alpha-beta", "auto", "cpu-8x1g.yaml"),
    ("nccl", "auto", "dgx-h100-32.yaml"),
]


def rate(model, op: Op, group: Group, n: int, repeats: int) -> float:
    """Best-of-``repeats`` estimates per second over ``n`` calls with varying sizes."""
    model.estimate(op, 1024, group)  # derive and cache the group's parameters first
    best = 0.0
    sizes = [8 << (i % 28) for i in range(n)]
    for _ in range(repeats):
        t0 = time.perf_counter()
        for s in sizes:
            model.estimate(op, s, group)
        best = max(best, n / (time.perf_counter() - t0))
    return best


def main() -> None:
    """Measure and print the table; write JSON next to the other results."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("-n", type=int, default=100_000, help="estimates per repeat")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/model_speed.json"))
    args = ap.parse_args()
    rows = []
    print(f"{'model':12s} {'algorithm':10s} {'topology':20s} {'op':15s} {'ranks':>6s} {'estimates/s':>12s}")
    for name, algo, topo_file in CASES:
        topo = load_topology(ROOT / "topologies" / topo_file)
        t0 = time.perf_counter()
        model = create_model(topo, name, algorithm=algo)
        build = time.perf_counter() - t0
        group = Group(range(topo.world_size))
        for op in (Op.ALL_REDUCE, Op.ALL_GATHER, Op.BROADCAST):
            r = rate(model, op, group, args.n, args.repeats)
            rows.append({"model": name, "algorithm": algo, "topology": topo_file, "op": op.value,
                         "ranks": topo.world_size, "estimates_per_s": round(r), "model_build_s": round(build, 4)})
            print(f"{name:12s} {algo:10s} {topo_file:20s} {op.value:15s} {topo.world_size:6d} {r:12,.0f}")
    doc = {"machine": {"python": platform.python_version(), "cpu": platform.processor() or platform.machine()},
           "goal": "alpha-beta >= 100,000 estimates/s", "rows": rows}
    Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")
    worst = min(r["estimates_per_s"] for r in rows if r["model"] == "alpha-beta")
    print(f"\nslowest alpha-beta case: {worst:,} estimates/s (goal 100,000) -> {'OK' if worst >= 100_000 else 'MISSED'}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
