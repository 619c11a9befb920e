"""Wire mode against model mode: DDP iteration time on a shaped 2-node cluster (root only).

For 100 Mbit/1 ms and 1 Gbit/100 µs links, ``examples/ddp_train.py`` runs as rank 0 of a
2-node switch topology, interleaved and repeated: in model mode (collectives complete at the
alpha-beta ring's times; with library gloo the model gives collective bytes TCP's payload
share of the link, see ``topology.graph.payload_efficiency``) and in wire mode (the gradients
really cross the shaped veths to a stub peer). Medians of per-run medians; JSON to
benchmarks/results/wire_vs_model.json.

Usage: sudo python benchmarks/wire_vs_model.py [--reps 3] [--steps 10]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = [("100Mbps", "1ms"), ("1Gbps", "100us")]


def topology(bw: str, lat: str, name: str) -> str:
    """A 2-node gloo cluster on one switch, alpha-beta ring."""
    return (f"name: {name}\ncluster: {{nodes: 2, device: cpu}}\nintra_node: {{fabric: shm}}\n"
            f"network: {{type: switch, link: {{bandwidth: {bw}, latency: {lat}}}}}\n"
            # gloo_threads 1: wire mode moves a group's ops one at a time, so model
            # mode is asked for the same (by default it runs two at once, as gloo does)
            "emulation: {library: gloo, model: alpha-beta, algorithm: ring, gloo_threads: 1}\n")


def run_once(yaml: Path, report: Path, steps: int, width: int, extra: list[str]) -> float:
    """One `nbox run`; returns its median iteration time (s)."""
    cmd = [sys.executable, "-m", "neuronabox.cli", "run", "-q", "--warmup", "2", "--report", str(report), *extra,
           str(yaml), "--", sys.executable, str(ROOT / "examples" / "ddp_train.py"), "--steps", str(steps),
           "--width", str(width)]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    return json.loads(report.read_text())["iteration_time"]["median"]


def measure(bw: str, lat: str, reps: int, steps: int, width: int, tmp: Path) -> dict:
    """Interleaved model / wire runs on one cluster."""
    from neuronabox.cluster import runtime as rt

    name = f"wvm{bw.lower().replace('bps', '')}"
    yaml = tmp / f"{name}.yaml"
    yaml.write_text(topology(bw, lat, name))
    rt.up(yaml, runtime="netns", name=name)
    out: dict[str, list[float]] = {"model": [], "wire": []}
    try:
        for _ in range(reps):
            out["model"].append(run_once(yaml, tmp / "m.json", steps, width, []))
            out["wire"].append(run_once(yaml, tmp / "w.json", steps, width, ["--cluster", name, "--mode", "wire"]))
    finally:
        rt.down(name)
    med = {k: statistics.median(v) for k, v in out.items()}

    def spread(v: list[float]) -> float:
        return (max(v) - min(v)) / statistics.median(v)

    return {
        "link": {"bandwidth": bw, "latency": lat},
        "runs": out,
        "median_s": med,
        "wire_vs_model": med["wire"] / med["model"] - 1,
        "spread": {k: spread(v) for k, v in out.items()},
    }


def main() -> int:
    """Run every configuration and write the JSON."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "wire_vs_model.json"))
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("wire_vs_model: needs root (network namespaces)", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="nbox-wvm-") as d:
        tmp = Path(d)
        os.environ.setdefault("NBOX_STATE_DIR", str(tmp / "state"))
        t0 = time.perf_counter()
        load_before = os.getloadavg()
        results = [measure(bw, lat, args.reps, args.steps, args.width, tmp) for bw, lat in CONFIGS]
        load_after = os.getloadavg()
    doc = {
        "benchmark": "wire_vs_model",
        "script": f"examples/ddp_train.py --steps {args.steps} --width {args.width} (2 ranks, {args.reps} interleaved reps)",
        "results": results,
        "seconds": time.perf_counter() - t0,
        # 1/5/15-minute load averages: a busy 2-core host slows wire mode's stub and relay (1 Gbit most).
        "loadavg": {"before": load_before, "after": load_after, "cpus": os.cpu_count(), "nice": os.nice(0)},
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")
    for r in results:
        m = r["median_s"]
        print(f"{r['link']['bandwidth']}/{r['link']['latency']}: model {m['model'] * 1e3:.1f} ms, wire {m['wire'] * 1e3:.1f} ms "
              f"({r['wire_vs_model']:+.1%}); spreads {', '.join(f'{k} {v:.1%}' for k, v in r['spread'].items())}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
