"""The paper's BERT what-if study on a GPU, through `nbox whatif`: iteration time versus injected all-reduce delay.

BERT-large (from a config), DDP, on the paper's 2-node topology with rank 0 real on this
machine's GPU; all-reduce delays 0, 1, 2, 5, 15 ms are injected. Small delays hide behind the
backward pass (DDP overlaps buckets with compute), larger ones show. `nbox whatif` writes the
CSV, the Markdown table, whatif.json and the plot into --out. Needs a CUDA GPU and transformers
(the lent H200 has both); about half a minute per delay. Run by `benchmarks/gpu_checks.sh`.

    python benchmarks/gpu_whatif.py                           # -> benchmarks/results/gpu_whatif/
    python benchmarks/gpu_whatif.py --tiny --out /tmp/w       # a tiny BERT on the CPU: checks the script
    nbox report benchmarks/results/gpu_whatif/whatif.json     # the plot again, where matplotlib is
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    """Run the sweep with `nbox whatif`; print its table."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--delays", default="0,1,2,5,15", help="injected all-reduce delays, ms")
    ap.add_argument("--steps", type=int, default=20, help="measured iterations a run (after 5 warm-up)")
    ap.add_argument("--repeats", type=int, default=1, help="runs per delay, interleaved")
    ap.add_argument("--topology", default=str(ROOT / "topologies/paper-2x1-100g.yaml"))
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/gpu_whatif")
    ap.add_argument("--tiny", action="store_true", help="a tiny BERT: checks the script without a GPU")
    args = ap.parse_args()
    delays = ",".join(f"{float(d):g}ms" for d in args.delays.split(","))
    workload = [sys.executable, str(ROOT / "benchmarks/workloads/bert_ddp.py"), "--steps", str(args.steps)]
    if args.tiny:
        workload += ["--tiny", "--seq", "64"]
    cmd = [sys.executable, "-m", "neuronabox.cli", "whatif", args.topology, "--sweep", f"inject.all_reduce={delays}",
           "--repeats", str(args.repeats), "--warmup", "5", "-o", str(args.out), "--", *workload]
    print("$", " ".join(cmd), flush=True)
    return subprocess.run(cmd, cwd=ROOT).returncode


if __name__ == "__main__":
    sys.exit(main())
