"""Fidelity table: 2-rank DDP, real system vs emulated (model mode after calibration, and wire mode), per model and network.

For each network (100 Mbit/s 1 ms, 1 Gbit/s 100 us, 10 Gbit/s 10 us) a 2-node netns cluster
comes up once; ``nbox calibrate`` measures gloo's all-reduce and broadcast on it (what DDP
uses) and fits the profile; then ``nbox validate`` runs each workload (MLP, small CNN, small
transformer from ``examples/fidelity_models.py``) as the real system and emulated with the
``calibrated`` model (and in wire mode where ``nbox run --mode wire`` exists), interleaved
and repeated. Writes ``benchmarks/results/fidelity_table.md`` (and ``.json``) with the
command that produced it.

The real system is noisy on a 2-core machine (DESIGN.md, "This machine"); a measurement for
the record needs a quiet machine: nothing else running, default repeats or more.

    python benchmarks/fidelity_table.py                 # the full table (about 20 min on a quiet machine)
    python benchmarks/fidelity_table.py --quick         # smoke run of every cell: 2 repeats, 10 steps
    python benchmarks/fidelity_table.py --render benchmarks/results/fidelity_table.json [--quick]
                                                        # rewrite the Markdown from a run's JSON
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

NETWORKS = {
    "100Mbit-1ms": ("100Mbps", "1ms"),
    "1Gbit-100us": ("1Gbps", "100us"),
    "10Gbit-10us": ("10Gbps", "10us"),
}
MODELS = ("mlp", "cnn", "transformer")
TOPOLOGY = """name: fid-{key}
description: 2 CPU nodes, one rank each, one {bw} link with {lat} one-way latency (the paper's 2-node setting)
cluster: {{nodes: 2, ranks_per_node: 1, device: cpu}}
network: {{type: ring, link: {{bandwidth: {bw}, latency: {lat}}}}}
emulation: {{library: gloo, real_ranks: [0], model: calibrated}}
"""


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--networks", default=",".join(NETWORKS), help="comma list of " + ", ".join(NETWORKS))
    p.add_argument("--models", default=",".join(MODELS), help="comma list of " + ", ".join(MODELS))
    p.add_argument("--repeats", type=int, default=5, help="runs of each system per cell, interleaved")
    p.add_argument("--steps", type=int, default=30, help="training steps per run")
    p.add_argument("--warmup", type=int, default=5, help="steps left out of each run")
    p.add_argument("--modes", default="model,wire")
    p.add_argument("--calibrate-sizes", default="4B:64MiB")
    p.add_argument("--quick", action="store_true", help="smoke run: 2 repeats, 10 steps, 3 warm-up, small calibration")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "fidelity_table.md")
    p.add_argument("--render", type=Path, help="only rewrite the Markdown from this JSON (written by an earlier run)")
    args = p.parse_args()
    if args.quick:
        args.repeats, args.steps, args.warmup, args.calibrate_sizes = 2, 10, 3, "4B:16MiB"
    if args.render:
        doc = json.loads(args.render.read_text())
        for k, v in doc.get("args", {}).items():
            setattr(args, k, v)
        write(args, doc["rows"], doc.get("modes", ["model", "wire"]), doc["command"], doc["seconds"])
        return 0
    if os.geteuid() != 0:
        print("fidelity_table: needs root (the real system runs in network namespaces)", file=sys.stderr)
        return 2

    from neuronabox.cluster import runtime as rt
    from neuronabox.fidelity.calibrate import default_sizes, parse_ops, parse_size_range, run_calibration, save_profile
    from neuronabox.fidelity.validate import run_validation
    from neuronabox.topology import load_topology

    nets = [n.strip() for n in args.networks.split(",") if n.strip()]
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    script = ROOT / "examples" / "fidelity_models.py"
    rows, t_all = [], time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="nbox-fidelity-") as tmp:
        tmpd = Path(tmp)
        os.environ.setdefault("NBOX_STATE_DIR", str(tmpd / "state"))
        for key in nets:
            bw, lat = NETWORKS[key]
            topo_file = tmpd / f"{key}.yaml"
            topo_file.write_text(TOPOLOGY.format(key=key.lower(), bw=bw, lat=lat))
            topo = load_topology(topo_file)
            name = f"fid{nets.index(key)}{os.getpid() % 10000}"
            up = rt.up(topo, runtime="netns", name=name)
            try:
                t0 = time.perf_counter()
                lo, hi = parse_size_range(args.calibrate_sizes)
                profile = run_calibration(topo, parse_ops("all_reduce,broadcast"), default_sizes(lo, hi), cluster=name)
                prof_file = tmpd / f"{key}.profile.json"
                save_profile(profile, prof_file)
                ar = profile["ops"]["all_reduce"]
                est = profile["link_estimate"]
                print(f"[{key}] calibrated in {time.perf_counter() - t0:.0f} s: all-reduce {len(ar['segments'])} segments, "
                      f"{est.get('all_reduce_payload_Bps', 0) * 8 / 1e6:.0f} Mbit/s, rms {ar['rms_rel_error']:.1%}", flush=True)
                for model in models:
                    cmd = [sys.executable, str(script), "--arch", model, "--steps", str(args.steps)]
                    v = run_validation(topo_file, cmd, warmup=args.warmup, repeats=args.repeats, tolerance=0.01,
                                       modes=modes, model="calibrated", profile=prof_file, cluster=name,
                                       progress=lambda m, k=key, mo=model: print(f"  [{k} {mo}] {m}", flush=True))
                    row = {"network": key, "workload": model, "iterations": v.iterations, "repeats": v.repeats,
                           "real_median_s": v.real.median_s, "real_p95_s": v.real.p95_s, "real_spread": v.real_spread,
                           "real_run_medians_s": v.real.run_medians_s,
                           "calibration": {"all_reduce_segments": ar["segments"], "rms_rel_error": ar["rms_rel_error"]}}
                    for m in v.modes:
                        row.setdefault("modes", {})[m.mode] = {"available": m.available, "why": m.why, "failed": m.failed, "median_s": m.median_s,
                                       "p95_s": m.p95_s, "error": m.error, "run_medians_s": m.run_medians_s}
                    rows.append(row)
                    print(f"[{key} {model}] real {_ms(v.real.median_s)} ms (spread {_pct(v.real_spread, False)}), "
                          + ", ".join(f"{m.mode} {_ms(m.median_s)} ms ({_pct(m.error)})" for m in v.modes), flush=True)
            finally:
                if not up.already_up:
                    rt.down(name)
    command = "python benchmarks/fidelity_table.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    write(args, rows, modes, command.strip(), time.perf_counter() - t_all)
    return 0


def _ms(v) -> str:
    return "-" if v is None else f"{v * 1e3:.2f}"


def _pct(v, sign: bool = True) -> str:
    return "-" if v is None else (f"{v * 100:+.2f}%" if sign else f"{v * 100:.2f}%")


def write(args, rows: list[dict], modes: list[str], command: str, seconds: float) -> None:
    """The Markdown table (and the JSON beside it)."""
    import torch

    out: Path = args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    head = "| network | workload | real median (ms) | real spread | model median (ms) | model error |"
    sep = "|---|---|---:|---:|---:|---:|"
    if "wire" in modes:
        head += " wire median (ms) | wire error |"
        sep += "---:|---:|"
    lines = [
        "# Fidelity: 2-rank DDP, real system vs NeuronaBox",
        "",
        f"Command: `{command}` (as root; {seconds / 60:.1f} min)",
        "",
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, torch {torch.__version__}, {os.cpu_count()} cores. "
        f"Each cell: {args.repeats} interleaved runs of each system, {args.steps} steps, the first {args.warmup} left out; "
        "medians over all measured iterations. Real: both ranks real, gloo over a tbf-shaped veth (delay by the user-space "
        "relay), each rank pinned to its own core. Model: rank 0 real under `nbox run`, rank 1 emulated by the `calibrated` "
        "model (profile from `nbox calibrate` on the same cluster: all-reduce and broadcast). Wire: `nbox run --mode wire`. "
        "Error = (emulated - real) / real median; real spread = (max - min) / median of the real runs' medians.",
        "",
        head,
        sep,
    ]
    for r in rows:
        mo = r["modes"].get("model") or {}
        line = (f"| {r['network']} | {r['workload']} | {_ms(r['real_median_s'])} | {_pct(r['real_spread'], False)} | "
                f"{_ms(mo.get('median_s'))} | {_pct(mo.get('error'))} |")
        if "wire" in modes:
            w = r["modes"].get("wire") or {}
            if not w.get("available"):
                line += f" n/a | {w.get('why', 'not run')} |"
            elif w.get("failed") or w.get("median_s") is None:
                line += f" failed | {w.get('failed') or 'a run did not finish'} |"
            else:
                line += f" {_ms(w.get('median_s'))} | {_pct(w.get('error'))} |"
        lines.append(line)
    if args.quick:
        lines += ["", "**Smoke run (`--quick`) on a shared, busy machine: these figures show the script works, "
                      "they are not a fidelity measurement. Run the full command on a quiet machine for the record.**"]
    out.write_text("\n".join(lines) + "\n", encoding="utf-8")
    keep = {k: getattr(args, k) for k in ("repeats", "steps", "warmup", "quick", "calibrate_sizes")}
    doc = {"command": command, "seconds": seconds, "modes": modes, "args": keep, "rows": rows}
    out.with_suffix(".json").write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {out} and {out.with_suffix('.json')}")


if __name__ == "__main__":
    sys.exit(main())
