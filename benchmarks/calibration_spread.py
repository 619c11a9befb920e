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
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bucket_timeline import parse_workload_args, run_workload, workload_args, workload_cluster  # noqa: E402  (one cluster, its runs)
from fidelity_table import calibrate  # noqa: E402  (the table's calibration)

MIB = 1 << 20


def profile_figures(profile: dict) -> dict[str, float | None]:
    """What moves the model most: the 1 MiB sweep median, two at once over serial at 1 MiB, the busy rate."""
    from neuronabox.fidelity.measure import pair_ratios

    sweep = {r["size"]: r["time_s"] for r in (profile.get("measurements") or {}).get("all_reduce", [])}
    pairs = dict(pair_ratios(profile.get("concurrency") or {}))
    busy = profile.get("busy_progress") or {}
    return {"all_reduce_1MiB_s": sweep.get(MIB), "pair_ratio_1MiB": pairs.get(MIB), "busy_rate": busy.get("rate")}


def summary(runs: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    """Per system: the median of its runs' iteration medians, and their range."""
    return {s: {"median": statistics.median(v), "min": min(v), "max": max(v)} for s, v in runs.items() if v}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    workload_args(p, "100Mbit-1ms")
    p.add_argument("--profiles", type=int, default=4, help="calibrations of the one cluster")
    p.add_argument("--keep", type=Path, help="keep the profiles here (and reuse those already there)")
    p.add_argument("--json", type=Path, help="write the runs and each profile's figures here")
    args = parse_workload_args(p, "calibration_spread")
    if args is None:
        return 2
    from neuronabox.fidelity.profile import save_profile
    from neuronabox.model.profile import load_profile

    systems = ["real"] + [f"profile {i}" for i in range(args.profiles)]
    runs: dict[str, list[float]] = {s: [] for s in systems}
    figures: dict[str, dict] = {}
    with workload_cluster(args.network, "spr", args.peer_noise) as cluster:
        tmpd, _, topo, name = cluster
        keep = args.keep or tmpd / "profiles"
        keep.mkdir(parents=True, exist_ok=True)
        profiles = []
        for i in range(args.profiles):
            path = keep / f"profile{i}.json"
            if not path.exists():
                t0 = time.perf_counter()
                save_profile(calibrate(topo, name), path)
                print(f"profile {i}: calibrated in {time.perf_counter() - t0:.0f} s", flush=True)
            profiles.append(path)
            figures[f"profile {i}"] = profile_figures(load_profile(path))
        for rnd in range(args.rounds):
            for s in systems:
                mode, profile = ("real", None) if s == "real" else ("model", profiles[int(s.split()[1])])
                rc, ph = run_workload(cluster, args, tmpd / f"{rnd}-{s.replace(' ', '')}", mode, profile)
                if ph is None:
                    print(f"round {rnd + 1} {s}: failed (status {rc})", file=sys.stderr)
                    continue
                runs[s].append(ph["iteration"])
                print(f"round {rnd + 1} {s}: iteration {runs[s][-1] * 1e3:.2f} ms", flush=True)
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
