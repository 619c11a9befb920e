"""How much the calibration moves model mode: K profiles of one cluster, each driving the same workload (root only).

The fidelity table compares one calibration's model against the real system; this separates the
calibration's own spread from the runs'. On one 2-node cluster of the table's kind it calibrates
K times (``nbox calibrate``'s measurement, as the table does), then runs the workload in
interleaved rounds: the real system, and model mode once per profile. Each profile's runs agree
closely with each other (within +-0.7 ms at 100 Mbit/s), so the spread between profiles is the
calibration's. It prints per system the rounds' iteration medians and, per profile, the figures
that moved the model most when this was written: the 1 MiB all-reduce's sweep median, two at
once over one after the other at 1 MiB, the busy rate.

    sudo .venv/bin/python benchmarks/calibration_spread.py --network 100Mbit-1ms --arch mlp \\
        --profiles 4 --rounds 3 --keep /tmp/spread      # ~12 min

Found with it (session 15, 100 Mbit/s MLP): four one-window calibrations read the 1 MiB op at
93.7-97.4 ms and drove the model to 142.7-148.7 ms; with the sweep in three passes, 92.8-94.8 ms
over eight, the model following the two-at-once ratio that remained (0.94-1.08).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bucket_timeline import phases  # noqa: E402  (one run's per-step medians)
from fidelity_table import NETWORKS, TOPOLOGY, calibrate  # noqa: E402  (the table's clusters and calibration)

MIB = 1 << 20


def profile_figures(profile: dict) -> dict[str, float | None]:
    """What moves the model most: the 1 MiB sweep median, two at once over serial at 1 MiB, the busy rate."""
    from neuronabox.fidelity.calibrate import pair_ratios

    sweep = {r["size"]: r["time_s"] for r in (profile.get("measurements") or {}).get("all_reduce", [])}
    pairs = dict(pair_ratios(profile.get("concurrency") or {}))
    busy = profile.get("busy_progress") or {}
    return {"all_reduce_1MiB_s": sweep.get(MIB), "pair_ratio_1MiB": pairs.get(MIB), "busy_rate": busy.get("rate")}


def summary(runs: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    """Per system: the median of its runs' iteration medians, and their range."""
    return {s: {"median": statistics.median(v), "min": min(v), "max": max(v)} for s, v in runs.items() if v}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--network", default="100Mbit-1ms", choices=list(NETWORKS))
    p.add_argument("--arch", default="mlp", choices=["mlp", "cnn", "transformer"])
    p.add_argument("--profiles", type=int, default=4, help="calibrations of the one cluster")
    p.add_argument("--rounds", type=int, default=3, help="interleaved runs of each system")
    p.add_argument("--steps", type=int, default=25)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--keep", type=Path, help="keep the profiles here (and reuse those already there)")
    p.add_argument("--json", type=Path, help="write the runs and each profile's figures here")
    args = p.parse_args()
    if os.geteuid() != 0:
        print("calibration_spread: needs root (the real system runs in network namespaces)", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    from neuronabox.cluster import runtime as rt
    from neuronabox.fidelity.calibrate import load_profile, save_profile
    from neuronabox.fidelity.validate import _run_emulated, launch_real, rank_cores, twin_ranks
    from neuronabox.topology import load_topology

    bw, lat = NETWORKS[args.network]
    systems = ["real"] + [f"profile {i}" for i in range(args.profiles)]
    runs: dict[str, list[float]] = {s: [] for s in systems}
    figures: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="nbox-spread-") as tmp:
        tmpd = Path(tmp)
        keep = args.keep or tmpd / "profiles"
        keep.mkdir(parents=True, exist_ok=True)
        os.environ.setdefault("NBOX_STATE_DIR", str(tmpd / "state"))
        topo_file = tmpd / "topology.yaml"
        topo_file.write_text(TOPOLOGY.format(key=args.network.lower(), bw=bw, lat=lat, noise="true"))
        topo = load_topology(topo_file)
        name = f"spr{os.getpid() % 10000}"
        up = rt.up(topo, runtime="netns", name=name)
        try:
            profiles = []
            for i in range(args.profiles):
                path = keep / f"profile{i}.json"
                if not path.exists():
                    t0 = time.perf_counter()
                    save_profile(calibrate(topo, name), path)
                    print(f"profile {i}: calibrated in {time.perf_counter() - t0:.0f} s", flush=True)
                profiles.append(path)
                figures[f"profile {i}"] = profile_figures(load_profile(path))
            core0 = rank_cores(topo.world_size)[0]
            for rnd in range(args.rounds):
                for s in systems:
                    log = tmpd / f"{rnd}-{s.replace(' ', '')}"
                    cmd = [sys.executable, str(ROOT / "examples" / "fidelity_models.py"), "--arch", args.arch,
                           "--steps", str(args.steps), "--bucket-log", str(log)]
                    if s == "real":
                        rc, _ = launch_real(name, topo, cmd, None, record_only=False)
                    else:
                        rc = _run_emulated(topo_file, cmd, "model", tmpd / "report.json", core0, name, None,
                                           profiles[int(s.split()[1])], tmpd / "emulated.log", 300.0,
                                           twins=twin_ranks(topo.world_size, 0))
                    got = Path(f"{log}.rank0.json")
                    if rc != 0 or not got.exists():
                        print(f"round {rnd + 1} {s}: failed (status {rc})", file=sys.stderr)
                        continue
                    runs[s].append(phases(json.loads(got.read_text()), args.warmup)["iteration"])
                    print(f"round {rnd + 1} {s}: iteration {runs[s][-1] * 1e3:.2f} ms", flush=True)
        finally:
            if not up.already_up:
                rt.down(name)
    print(f"\n{args.network} {args.arch}: iteration medians of each run (ms)")
    for s in systems:
        line = f"{s:>10}: " + " ".join(f"{v * 1e3:.2f}" for v in runs[s])
        f = figures.get(s)
        if f:
            line += (f"   | 1 MiB {f['all_reduce_1MiB_s'] * 1e3:.1f} ms" if f["all_reduce_1MiB_s"] else "")
            line += (f", two at once {f['pair_ratio_1MiB']:.3f} of serial" if f["pair_ratio_1MiB"] else "")
            line += (f", busy {f['busy_rate']:.2f}" if f["busy_rate"] is not None else "")
        print(line)
    if args.json:
        args.json.write_text(json.dumps({"network": args.network, "arch": args.arch, "runs": runs,
                                         "summary": summary(runs), "profiles": figures}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
