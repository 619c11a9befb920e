"""The paper's BERT what-if study on a GPU: iteration time versus injected all-reduce delay.

BERT-large (from a config), DDP, on the paper's 2-node topology with rank 0 real on this
machine's GPU; all-reduce delays 0, 1, 2, 5, 15 ms are injected. Small delays hide behind the
backward pass (DDP overlaps buckets with compute), larger ones show. Writes a Markdown table,
JSON and a PNG to benchmarks/results/. Needs a CUDA GPU and transformers (the lent H200 has
both); about 1 minute per delay.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "results"


def main() -> None:
    """Run each delay, print and save the table and the plot."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--delays", default="0,1,2,5,15", help="injected all-reduce delays, ms")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--topology", default=str(ROOT / "topologies/paper-2x1-100g.yaml"))
    ap.add_argument("--tiny", action="store_true", help="a tiny BERT: checks the script without a GPU")
    args = ap.parse_args()
    rows = []
    for d in [float(x) for x in args.delays.split(",")]:
        cmd = [sys.executable, "-m", "neuronabox.cli", "run", args.topology, "--inject", f"all_reduce=+{d}ms", "-q",
               "--", sys.executable, str(ROOT / "benchmarks/workloads/bert_ddp.py"), "--steps", str(args.steps)]
        if args.tiny:
            cmd += ["--tiny", "--seq", "64"]
        out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, check=True).stdout
        times = json.loads(next(line for line in out.splitlines() if line.startswith("ITER_TIMES "))[11:])
        rows.append({"delay_ms": d, "median_ms": statistics.median(times) * 1e3, "p95_ms": sorted(times)[int(0.95 * (len(times) - 1))] * 1e3})
        print(f"delay {d:5.1f} ms -> median iteration {rows[-1]['median_ms']:8.2f} ms", flush=True)
    base = rows[0]["median_ms"]
    table = ["| injected all-reduce delay (ms) | median iteration (ms) | p95 (ms) | added (ms) |", "|---:|---:|---:|---:|"]
    table += [f"| {r['delay_ms']:g} | {r['median_ms']:.2f} | {r['p95_ms']:.2f} | {r['median_ms'] - base:+.2f} |" for r in rows]
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "gpu_whatif.md").write_text("\n".join(table) + "\n")
    (OUT / "gpu_whatif.json").write_text(json.dumps(rows, indent=2) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    xs = [r["delay_ms"] for r in rows]
    ax.plot(xs, [r["median_ms"] for r in rows], "o-", label="emulated (median)")
    ax.plot(xs, [base + x for x in xs], "--", color="gray", label="no overlap (base + delay)")
    ax.set_xlabel("injected all-reduce delay (ms)")
    ax.set_ylabel("iteration time (ms)")
    ax.set_title("BERT-large, DDP, 2 nodes x 1 GPU" + (" (tiny, CPU check)" if args.tiny else ""))
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(OUT / "gpu_whatif.png", dpi=120)
    print("\n".join(table))


if __name__ == "__main__":
    main()
