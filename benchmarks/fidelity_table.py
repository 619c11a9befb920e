"""Fidelity table: 2-rank DDP, real system vs emulated (model mode after calibration, and wire mode), per model and network.

The command for the record (as root, on a quiet machine: nothing else running; about 20-25 min
on the 2-core development machine):

    .venv/bin/python benchmarks/fidelity_table.py

It writes ``benchmarks/results/fidelity_table.md`` and ``.json`` (date, machine, load
average before and after, the command). Other forms:

    .venv/bin/python benchmarks/fidelity_table.py --quick   # smoke run of every cell: 2 repeats, 10 steps (~8 min)
    .venv/bin/python benchmarks/fidelity_table.py --networks 10Gbit-10us --models cnn --modes model --repeats 2 \
        --out /tmp/cell.md                                   # one cell
    .venv/bin/python benchmarks/fidelity_table.py --render benchmarks/results/fidelity_table.json
                                                             # rewrite the Markdown from a run's JSON

For each network (100 Mbit/s 1 ms, 1 Gbit/s 100 us, 10 Gbit/s 10 us) a 2-node netns cluster
comes up once; ``nbox calibrate`` measures gloo's all-reduce and broadcast on it (what DDP
uses), fits the profile, and names it in the cell's topology file (``emulation.profile``, as
``nbox calibrate --write-topology`` does); then ``nbox validate`` runs each workload (MLP,
small CNN, small transformer from ``examples/fidelity_models.py``) as the real system and
emulated with the ``calibrated`` model (and in wire mode), interleaved and repeated, with
the load twin on (``--no-twin`` turns it off): both real ranks share this machine, so during
each emulated run the other rank runs too, as its own ``nbox run`` pinned to its core.

The real system is noisy on a 2-core machine (DESIGN.md, "This machine"): each cell reports
the real system's own run-to-run spread beside each error, and the verdict says when an error
is within that spread.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
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
CALIBRATE_SIZES = "4B:64MiB"
CALIBRATE_BUDGET_S = 4.0
TOPOLOGY = """name: fid-{key}
description: 2 CPU nodes, one rank each, one {bw} link with {lat} one-way latency (the paper's 2-node setting)
cluster: {{nodes: 2, ranks_per_node: 1, device: cpu}}
network: {{type: ring, link: {{bandwidth: {bw}, latency: {lat}}}}}
emulation: {{library: gloo, real_ranks: [0], model: calibrated, peer_noise: {noise}}}
"""


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--networks", default=",".join(NETWORKS), help="comma list of " + ", ".join(NETWORKS))
    p.add_argument("--models", default=",".join(MODELS), help="comma list of " + ", ".join(MODELS))
    p.add_argument("--repeats", type=int, default=5, help="runs of each system per cell, interleaved")
    p.add_argument("--steps", type=int, default=30, help="training steps per run")
    p.add_argument("--warmup", type=int, default=5, help="steps left out of each run")
    p.add_argument("--modes", default="model,wire",
                   help="comma list of model, wire, real-again (the real system rerun: the error a perfect emulator reads here)")
    p.add_argument("--calibrate-sizes", default=CALIBRATE_SIZES)
    p.add_argument("--calibrate-budget", type=float, default=CALIBRATE_BUDGET_S,
                   help="seconds of samples per size (nbox calibrate --budget): DDP's bucket sizes are noisy at 100 Mbit/s "
                        "(0.6 s, 3 samples of a 2 MiB all-reduce: the fitted bandwidth moved 4%% between calibrations; "
                        "2 s, 10 samples: 2%%, and the 2 MiB point itself 192-204 ms; 4 s: 20 samples)")
    p.add_argument("--no-peer-noise", dest="peer_noise", action="store_false",
                   help="emulated rank 1 arrives with rank 0 (topology emulation.peer_noise: false); by default it varies "
                        "as rank 0 does, as the real rank 1 does, and DDP waits for the later of the two")
    p.add_argument("--no-twin", dest="twin", action="store_false",
                   help="no load twin (for a real system on separate machines; here it measures the sharing, not the emulator)")
    p.add_argument("--quick", action="store_true", help="smoke run: 2 repeats, 10 steps, 3 warm-up, small calibration")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "fidelity_table.md")
    p.add_argument("--render", type=Path, help="only rewrite the Markdown from this JSON (written by an earlier run)")
    args = p.parse_args()
    if args.quick:
        args.repeats, args.steps, args.warmup, args.calibrate_sizes = 2, 10, 3, "4B:16MiB"
    if args.render:
        doc = json.loads(args.render.read_text())
        args.twin = False  # a JSON from before the load twin existed says nothing about it
        args.peer_noise = False  # nor one from before peer noise
        for k, v in doc.get("args", {}).items():
            setattr(args, k, v)
        write(args, doc["rows"], doc.get("modes", ["model", "wire"]), doc["command"], doc["seconds"], doc.get("machine"))
        return 0
    if os.geteuid() != 0:
        print("fidelity_table: needs root (the real system runs in network namespaces)", file=sys.stderr)
        return 2

    # SIGTERM (timeout, kill) as an exit, so the finally below takes each cluster down.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    from neuronabox.cluster import runtime as rt
    from neuronabox.fidelity.profile import save_profile, write_profile_field
    from neuronabox.emu.host_effects.footprint import interference
    from neuronabox.fidelity.validate import run_validation
    from neuronabox.topology import load_topology

    nets = [n.strip() for n in args.networks.split(",") if n.strip()]
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    script = ROOT / "examples" / "fidelity_models.py"
    rows, t_all = [], time.perf_counter()
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="nbox-fidelity-") as tmp:
        tmpd = Path(tmp)
        os.environ.setdefault("NBOX_STATE_DIR", str(tmpd / "state"))
        for key in nets:
            bw, lat = NETWORKS[key]
            topo_file = tmpd / f"{key}.yaml"
            topo_file.write_text(TOPOLOGY.format(key=key.lower(), bw=bw, lat=lat, noise=str(args.peer_noise).lower()))
            topo = load_topology(topo_file)
            name = f"fid{nets.index(key)}{os.getpid() % 10000}"
            up = rt.up(topo, runtime="netns", name=name)
            try:
                t0 = time.perf_counter()
                profile = calibrate(topo, name, args.calibrate_sizes, args.calibrate_budget)
                prof_file = tmpd / f"{key}.profile.json"
                save_profile(profile, prof_file)
                # The workflow a user follows: the topology names its profile (model calibrated by default).
                write_profile_field(topo_file, prof_file)
                ar = profile["ops"]["all_reduce"]
                est = profile["link_estimate"]
                bp, cost = profile.get("busy_progress") or {}, profile.get("cpu_cost") or {}
                print(f"[{key}] calibrated in {time.perf_counter() - t0:.0f} s: all-reduce {len(ar['segments'])} segments, "
                      f"{est.get('all_reduce_payload_Bps', 0) * 8 / 1e6:.0f} Mbit/s, rms {ar['rms_rel_error']:.1%}, "
                      f"busy progress {bp.get('rate', 1.0):.2f}, "
                      f"cpu {cost.get('per_byte_s', 0) * 1e9:.1f} ns/B per rank "
                      f"({cost.get('process_per_byte_s', 0) * 1e9:.1f} in its process), "
                      f"x {interference(profile) or 1.0:.2f} for the compute lost beside an op "
                      f"(ranks {', '.join(f'{x * 1e3:.1f}' for x in bp.get('lost_compute_s', []))} ms)",
                      flush=True)
                for model in models:
                    cmd = [sys.executable, str(script), "--arch", model, "--steps", str(args.steps)]
                    v = run_validation(topo_file, cmd, warmup=args.warmup, repeats=args.repeats, tolerance=0.01,
                                       modes=modes, cluster=name, twin=args.twin,
                                       progress=lambda m, k=key, mo=model: print(f"  [{k} {mo}] {m}", flush=True))
                    row = {"network": key, "workload": model, "iterations": v.iterations, "repeats": v.repeats,
                           "model": v.model, "twin_ranks": v.twin_ranks,
                           "real_median_s": v.real.median_s, "real_p95_s": v.real.p95_s, "real_spread": v.real_spread,
                           "real_run_medians_s": v.real.run_medians_s,
                           "calibration": {"all_reduce_segments": ar["segments"], "rms_rel_error": ar["rms_rel_error"],
                                           "busy_progress": bp.get("rate"),
                                           "lost_compute_s": bp.get("lost_compute_s"),
                                           "interference": interference(profile),
                                           "concurrency": {k: v for k, v in (profile.get("concurrency") or {}).items()
                                                           if k in ("size", "single_s", "pair_s", "sec_per_byte", "points")} or None,
                                           "cpu_cost": {k: v for k, v in cost.items()
                                                        if k in ("per_op_s", "per_byte_s", "process_per_byte_s")},
                                           "spin_stall": [{k: c[k] for k in ("size", "gap_s", "spun", "median_excess_s",
                                                                             "median_spin_stall_s")}
                                                          for c in (profile.get("spin_stall") or {}).get("cells", [])]}}
                    for m in v.modes:
                        row.setdefault("modes", {})[m.mode] = {"available": m.available, "why": m.why, "failed": m.failed, "median_s": m.median_s,
                                       "p95_s": m.p95_s, "error": m.error, "run_medians_s": m.run_medians_s,
                                       "verdict": m.verdict}
                    rows.append(row)
                    print(f"[{key} {model}] real {_ms(v.real.median_s)} ms (spread {_pct(v.real_spread, False)}), "
                          + ", ".join(f"{m.mode} {_ms(m.median_s)} ms ({_pct(m.error)})" for m in v.modes), flush=True)
            finally:
                if not up.already_up:
                    rt.down(name)
    command = "python benchmarks/fidelity_table.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    write(args, rows, modes, command.strip(), time.perf_counter() - t_all, _machine(load_before, os.getloadavg()))
    return 0


def calibrate(topo, cluster: str, sizes: str = CALIBRATE_SIZES, budget_s: float = CALIBRATE_BUDGET_S) -> dict:
    """A cell's profile: ``nbox calibrate`` of gloo's all-reduce and broadcast (what DDP uses) on its cluster."""
    from neuronabox.fidelity.calibrate import default_sizes, parse_ops, parse_size_range, run_calibration

    lo, hi = parse_size_range(sizes)
    return run_calibration(topo, parse_ops("all_reduce,broadcast"), default_sizes(lo, hi), cluster=cluster,
                           budget_s=budget_s)


def _machine(load_before, load_after) -> dict:
    """What the figures were measured on, and how busy it was (a loaded 2-core machine skews the real system)."""
    import platform

    import torch

    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor())
    return {"cpu": cpu, "cores": os.cpu_count(), "kernel": platform.release(), "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "loadavg_before": [round(x, 2) for x in load_before], "loadavg_after": [round(x, 2) for x in load_after]}


def _ms(v) -> str:
    return "-" if v is None else f"{v * 1e3:.2f}"


def _pct(v, sign: bool = True) -> str:
    return "-" if v is None else (f"{v * 100:+.2f}%" if sign else f"{v * 100:.2f}%")


def _error_cell(m: dict, real_runs: list[float] | None = None) -> str:
    """Error of the median, marked when it is within the real system's own spread, with its run-bootstrap interval."""
    from neuronabox.stats import error_interval

    if not m.get("available", True):
        return f"n/a ({m.get('why', 'not run')})"
    if m.get("failed") or m.get("median_s") is None:
        return f"failed: {m.get('failed') or 'a run did not finish'}"
    cell = _pct(m.get("error")) + (" ≈" if "within the real spread" in (m.get("verdict") or "") else "")
    ci = error_interval(real_runs or [], m.get("run_medians_s") or [])
    return cell + (f" [{ci[0] * 100:+.1f}, {ci[1] * 100:+.1f}]" if ci else "")


def write(args, rows: list[dict], modes: list[str], command: str, seconds: float, machine: dict | None = None) -> None:
    """The Markdown table (and the JSON beside it)."""
    from neuronabox.fidelity.measure import pair_ratios
    from neuronabox.units import format_size

    out: Path = args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    machine = machine or {}
    head = "| network | workload | real median (ms) | real spread |"
    sep = "|---|---|---:|---:|"
    for mode in modes:
        head += f" {mode} median (ms) | {mode} error |"
        sep += "---:|---:|"
    twin = getattr(args, "twin", True)
    noise = getattr(args, "peer_noise", False)
    lines = [
        "# Fidelity: 2-rank DDP, real system vs NeuronaBox",
        "",
        f"Command: `{command}` (as root; {seconds / 60:.1f} min)",
        "",
        f"{machine.get('date', 'date not recorded')}; machine: "
        f"{machine.get('cpu', '?')}, {machine.get('cores', os.cpu_count())} cores, kernel {machine.get('kernel', '?')}, "
        f"torch {machine.get('torch', '?')}; load average before {machine.get('loadavg_before', '?')}, "
        f"after {machine.get('loadavg_after', '?')}.",
        "",
        f"Each cell: {args.repeats} interleaved runs of each system, {args.steps} steps, the first {args.warmup} left out; "
        "medians over all measured iterations. Real: both ranks real, gloo over a tbf-shaped veth (delay by the user-space "
        "relay), each rank pinned to its own core. Model: rank 0 real under `nbox run`, rank 1 emulated by the `calibrated` "
        "model (profile from `nbox calibrate` on the same cluster: all-reduce and broadcast, named by the topology's "
        "`emulation.profile`). Wire: `nbox run --mode wire`. "
        + ("Real-again (`--modes ...,real-again`): the real system run a second time in a slot of its own, interleaved "
           "like the modes, and its error computed the same way: what a perfect emulator would read on this machine. "
           if "real-again" in modes else "")
        + ("Load twin on: during each emulated run, rank 1 also runs as its own `nbox run` (model mode) pinned to its core, "
           "so rank 0 computes on a machine as busy as in the real system. " if twin else
           "No load twin (`--no-twin`): the emulated rank 0 has the machine to itself. ")
        + ("Peer noise on (`emulation.peer_noise`): each iteration the emulated rank 1 arrives at the collectives as late "
           "as a draw from rank 0's own recent compute times says, and DDP waits for it. " if noise else "")
        + "Spin stalls (both modes, where the profile measured them): each op issued on an idle communicator waits "
        "as long as a sample of what ops issued after compute took beyond the calibration's sweep, gloo's I/O thread "
        "spinning on a rank's core meanwhile (README, \"A CPU library's collectives\"). "
        + "Error = (emulated - real) / real median; real spread = (max - min) / median of the real runs' medians; "
        "≈ marks an error within the real spread; [a, b] is the error's 95% bootstrap interval over whole runs "
        "(each system's run medians resampled, 2000 draws): where it is wider than ±1%, these runs cannot tell "
        "a 1% error from none. It leaves out the variation between calibrations (model mode) and between "
        "cluster instances, which is larger here: an earlier version of the code gave the 100 Mbit/s CNN model "
        "errors of +12.9%, +1.75% and +9.2% in three runs of this table, each run's own model medians within 2%.",
        "",
        head,
        sep,
    ]
    for r in rows:
        line = f"| {r['network']} | {r['workload']} | {_ms(r['real_median_s'])} | {_pct(r['real_spread'], False)} |"
        for mode in modes:
            m = r["modes"].get(mode) or {}
            line += f" {_ms(m.get('median_s'))} | {_error_cell(m, r.get('real_run_medians_s'))} |"
        lines.append(line)
    seen = set()
    for r in rows:
        c = r.get("calibration") or {}
        if r["network"] in seen or not c:
            continue
        if not seen:
            lines += ["", "Calibration (`nbox calibrate` on each network's cluster, before its rows):", ""]
        seen.add(r["network"])
        segs = c.get("all_reduce_segments") or [{}]
        bw = segs[-1].get("bandwidth_Bps")
        cost, pair, lost = c.get("cpu_cost") or {}, c.get("concurrency") or {}, c.get("lost_compute_s") or []
        parts = [f"all-reduce bus bandwidth {bw * 8 / 1e6:.0f} Mbit/s" if bw else "all-reduce", f"rms {c.get('rms_rel_error', 0):.1%}"]
        if c.get("busy_progress") is not None:
            parts.append(f"busy progress {c['busy_progress']:.2f}")
        if cost:
            parts.append(f"host CPU {cost.get('per_byte_s', 0) * 1e9:.1f} ns/B per rank ({cost.get('process_per_byte_s', 0) * 1e9:.1f} "
                         "in its process)")
        if lost:
            parts.append(f"compute lost beside an op {', '.join(f'{x * 1e3:.1f}' for x in lost)} ms by rank: "
                         f"x {c.get('interference') or 1.0:.2f}")
        stall = c.get("spin_stall") or []
        if stall:
            gaps = "/".join(f"{g * 1e3:g}" for g in sorted({x["gap_s"] for x in stall}))
            parts.append(f"after compute ({gaps} ms), an all-reduce's median extra time over the sweep: " + "; ".join(
                f"{format_size(size)} " + "/".join(f"{x['median_excess_s'] * 1e3:.1f}" for x in stall if x["size"] == size) + " ms"
                for size in sorted({x["size"] for x in stall})) + " (gloo spun on a rank's core in "
                + f"{min(x['spun'] for x in stall):.0%}-{max(x['spun'] for x in stall):.0%} of them)")
        if pair:
            parts.append(f"two at once: {pair['size'] >> 10} KiB all-reduce {pair['single_s'] * 1e3:.1f} ms alone, "
                         f"{pair['pair_s'] * 1e3:.1f} ms for two")
            ratios = pair_ratios(pair)
            if len(ratios) > 1:
                parts[-1] += "; two at once over one after the other: " + ", ".join(
                    f"{format_size(size)} {r:.2f}" for size, r in ratios)
        lines.append(f"- {r['network']}: " + "; ".join(parts) + ".")
    if args.quick:
        lines += ["", "**Smoke run (`--quick`): these figures show the script works, they are not a fidelity "
                      "measurement. Run the full command on a quiet machine for the record.**"]
    out.write_text("\n".join(lines) + "\n", encoding="utf-8")
    keep = {k: getattr(args, k) for k in ("repeats", "steps", "warmup", "quick", "calibrate_sizes", "calibrate_budget", "twin", "peer_noise")
            if hasattr(args, k)}
    doc = {"command": command, "seconds": seconds, "machine": machine, "modes": modes, "args": keep, "rows": rows}
    out.with_suffix(".json").write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {out} and {out.with_suffix('.json')}")


if __name__ == "__main__":
    sys.exit(main())
