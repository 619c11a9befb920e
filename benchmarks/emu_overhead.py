"""What the emulator costs the real rank (issue 3 goals), measured with interleaved, repeated runs.

1. Overhead: a small CNN's and an MLP's median iteration time under `nbox run` with the zero-cost
   `ideal` model (64 ranks) versus the same script with no torch.distributed at all, and
   versus DDP on a real 1-rank gloo group (what DDP itself costs). Goal: at most 2%.
2. Completion lateness (actual minus modeled finish) of blocking all-reduces whose modeled
   duration is ~1 ms. Goal: p99 <= 200 us on CPU.
3. The emulator's own CPU time per collective (ideal model, 1 KiB all-reduce).

Run: `.venv/bin/python benchmarks/emu_overhead.py` (about 3 minutes); writes
benchmarks/results/emu_overhead.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORK = ROOT / "benchmarks" / "workloads"
sys.path.insert(0, str(ROOT))
from neuronabox.stats import percentile  # noqa: E402

LATENCY_TOPOLOGY = """
name: lateness-probe
cluster: {nodes: 8}
network: {type: switch, link: {bandwidth: 10Gbps, latency: 60us}}
emulation: {library: gloo, algorithm: ring}
"""


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.update({"OMP_NUM_THREADS": "1", "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29533"})
    return env


def _grab(stdout: str, tag: str):
    for line in stdout.splitlines():
        if line.startswith(tag + " "):
            return json.loads(line[len(tag) + 1:])
    raise RuntimeError(f"no {tag} line in output:\n{stdout[-2000:]}")


def _nbox(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "neuronabox.cli", *args], capture_output=True, text=True,
                          cwd=ROOT, env=_env(), check=True)


def overhead(repeats: int, iters: int, arch: str) -> dict:
    """Median iteration time per variant, runs interleaved so machine noise hits all alike."""
    script = str(WORK / "train_loop.py")
    common = ["--arch", arch, "--iters", str(iters)]
    variants = {
        "plain (no torch.distributed)": lambda: subprocess.run(
            [sys.executable, script, "--mode", "plain", *common], capture_output=True, text=True,
            env=_env(), check=True).stdout,
        "DDP, real 1-rank gloo": lambda: subprocess.run(
            [sys.executable, script, "--mode", "ddp", *common], capture_output=True, text=True,
            env=_env(), check=True).stdout,
        "DDP, nbox run, 64 ranks, ideal model": lambda: _nbox(
            "run", "topologies/cpu-64-demo.yaml", "--model", "ideal", "-q", "--",
            sys.executable, script, "--mode", "ddp", *common).stdout,
    }
    samples: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(repeats):
        for name, fn in variants.items():
            samples[name].append(statistics.median(_grab(fn(), "ITER_TIMES")))
    med = {k: statistics.median(v) for k, v in samples.items()}
    plain, gloo, nbox = med.values()
    return {
        "median_iteration_s": med,
        "runs": samples,
        "overhead_vs_plain": nbox / plain - 1,
        "overhead_vs_real_ddp": nbox / gloo - 1,
        "ddp_itself_vs_plain": gloo / plain - 1,
    }


def lateness(calls: int) -> dict:
    """Lateness of blocking all-reduces from the run record."""
    with tempfile.TemporaryDirectory() as tmp:
        topo = Path(tmp) / "t.yaml"
        topo.write_text(LATENCY_TOPOLOGY)
        rep = Path(tmp) / "r.json"
        _nbox("run", str(topo), "--report", str(rep), "-q", "--", sys.executable, str(WORK / "collective_loop.py"), str(calls))
        doc = json.loads(rep.read_text())
    late = [o["lateness"] for o in doc["ops"] if o.get("lateness") is not None]
    modeled = statistics.median(o["duration"] for o in doc["ops"])
    return {"ops": len(late), "modeled_duration_s": modeled, "p50_s": percentile(late, 50),
            "p99_s": percentile(late, 99), "max_s": max(late)}


def cpu_per_collective(calls: int) -> dict:
    """The real rank's CPU time per all-reduce under the ideal model."""
    out = _nbox("run", "topologies/cpu-64-demo.yaml", "--model", "ideal", "-q", "--",
                sys.executable, str(WORK / "collective_loop.py"), str(calls)).stdout
    return _grab(out, "LOOP")


def main() -> None:
    """Run the three measurements, print them, write JSON."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--iters", type=int, default=60)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/emu_overhead.json"))
    args = ap.parse_args()
    o = {}
    for arch in ("cnn", "mlp"):
        o[arch] = overhead(args.repeats, args.iters, arch)
        print(f"{arch}: iteration time (median of run medians):")
        for k, v in o[arch]["median_iteration_s"].items():
            print(f"  {k:40s} {v * 1e3:8.3f} ms")
        print(f"  nbox (DDP) vs plain:           {o[arch]['overhead_vs_plain']:+.2%} (goal <= 2%)")
        print(f"  nbox vs the same DDP for real: {o[arch]['overhead_vs_real_ddp']:+.2%} (the emulator's own share)")
        print(f"  DDP itself vs plain:           {o[arch]['ddp_itself_vs_plain']:+.2%}")
    lat = lateness(args.calls)
    print(f"lateness over {lat['ops']} blocking all-reduces of {lat['modeled_duration_s'] * 1e6:.0f} us modeled: "
          f"p50 {lat['p50_s'] * 1e6:.1f} us, p99 {lat['p99_s'] * 1e6:.1f} us (goal <= 200), max {lat['max_s'] * 1e6:.0f} us")
    cpu = cpu_per_collective(args.calls * 5)
    print(f"emulator cost per all-reduce (ideal model): {cpu['cpu_s_per_call'] * 1e6:.1f} us CPU, "
          f"{cpu['wall_s_per_call'] * 1e6:.1f} us wall")
    doc = {"machine": {"python": platform.python_version(), "cpus": os.cpu_count(),
                       "load_avg": os.getloadavg()}, "overhead": o, "lateness": lat, "cpu_per_collective": cpu}
    Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
