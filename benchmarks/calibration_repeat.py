"""Do two calibrations of one cluster predict the same? N calibrations at each rate, what moves between them, and what their own samples allow.

For each link rate: a 2-node netns cluster (1 rank each, gloo), ``--calibrations`` independent
``nbox calibrate`` sweeps (all-reduce and broadcast, 4 B to 8 MiB: what DDP runs), then for each
of the three ``examples/fidelity_models.py`` workloads the modeled communication of one steady
iteration (its collectives, as ``nbox run`` records them) under each profile. The spread of those
predictions between calibrations is the calibration's noise on this host.

Beside it, figures that do not depend on this host's load while the benchmark runs, from each
profile's own samples (``neuronabox.fidelity.resample``): the same prediction with each size's
time its samples' median (the estimator before ``settle_times``) and settled; its bootstrap
standard deviation (every size's samples redrawn, refitted); the difference between the halves
of the sweep's rounds; and the bootstrap spread of the host-coupling figures (busy rate, two at
once over serial, spin-stall excess).

    sudo .venv/bin/python benchmarks/calibration_repeat.py          # -> benchmarks/results/calibration_repeat.md
    .venv/bin/python benchmarks/calibration_repeat.py --from OLD.json --out NAME   # re-analyse saved profiles (no root)
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from neuronabox.collectives import Op  # noqa: E402
from neuronabox.errors import InputError  # noqa: E402
from neuronabox.fidelity.calibrate import BUCKET_PRECISION, default_sizes, parse_precision, run_calibration  # noqa: E402
from neuronabox.fidelity.profile import save_profile  # noqa: E402
from neuronabox.fidelity.resample import bootstrap, figure_draws, halves, refit, relative_sd, spread  # noqa: E402
from neuronabox.model.calibrated import CalibratedModel  # noqa: E402
from neuronabox.topology import load_topology  # noqa: E402

OUT = ROOT / "benchmarks" / "results"
ARCHS = ("mlp", "cnn", "transformer")
TOPO = """name: rep{mbit}
cluster: {{nodes: 2}}
network: {{type: ring, link: {{bandwidth: {mbit}Mbps, latency: 100us}}}}
emulation: {{library: gloo}}
"""


def workload_ops(topo_file: Path, profile: Path, arch: str, folder: Path) -> list[tuple[str, int]]:
    """The collectives of one steady iteration of a workload (the third), as nbox run records them."""
    report = folder / f"{arch}.json"
    subprocess.run([sys.executable, "-m", "neuronabox.cli", "run", str(topo_file), "-q", "--profile", str(profile),
                    "--report", str(report), "--", sys.executable, str(ROOT / "examples" / "fidelity_models.py"),
                    "--arch", arch, "--steps", "4"], check=True, capture_output=True, timeout=600)
    ops = json.loads(report.read_text())["ops"]
    return [(o["op"], int(o["nbytes"])) for o in ops if o["iteration"] == 2]


def predict(model: CalibratedModel, seq: list) -> float:
    """The modeled communication of one iteration (the sum of its collectives) under a calibrated model."""
    return sum(model.estimate(Op.parse(op), nbytes, range(2)).duration for op, nbytes in seq)


def analyse(topo, profiles: list[dict], ops: dict[str, list], draws: int, rng: random.Random) -> tuple[dict, list[str]]:
    """Per workload: each calibration's prediction (median and settled), its bootstrap sd and halves' difference; per figure its spreads."""
    doc: dict = {"workloads": {}, "figures": {}}
    n = len(profiles)
    lines = ["| workload | estimator | " + " | ".join(f"cal {k + 1} (ms)" for k in range(n)) +
             " | spread | bootstrap sd (mean) | halves differ (mean) |", "|---|---|" + "---|" * (n + 3)]
    # Each profile refitted once per draw (and per half), every workload predicted from the same refits.
    models: dict[str, list] = {}
    for settle in (False, True):
        per = []
        for p in profiles:
            meas = p["measurements"]
            per.append((CalibratedModel(topo, profile=refit(p, meas, settle)),
                        [CalibratedModel(topo, profile=refit(p, bootstrap(meas, rng), settle)) for _ in range(draws)],
                        [CalibratedModel(topo, profile=refit(p, h, settle)) for h in halves(meas)]))
        models["settled" if settle else "median"] = per
    for arch, seq in ops.items():
        row: dict = {"ops": seq}
        for name, per in models.items():
            preds, sds, halfs = [], [], []
            for base, drawn, (a, b) in per:
                preds.append(predict(base, seq))
                sds.append(relative_sd(predict(m, seq) for m in drawn))
                ta, tb = predict(a, seq), predict(b, seq)
                halfs.append(abs(ta - tb) / ((ta + tb) / 2))
            row[name] = {"predicted_s": preds, "spread": spread(preds), "bootstrap_sd": sds, "halves": halfs}
            lines.append(f"| {arch} | {name} | " + " | ".join(f"{x * 1e3:.2f}" for x in preds) +
                         f" | {spread(preds):.2%} | {statistics.fmean(sds):.2%} | {statistics.fmean(halfs):.2%} |")
        doc["workloads"][arch] = row
    # The host-coupling figures: per calibration its value (the median of its draws) and bootstrap sd.
    per_cal = [figure_draws(p, rng, draws) for p in profiles]
    names = sorted(set().union(*per_cal), key=lambda k: (k.split("_")[0], len(k), k))
    cpu = [(p.get("cpu_cost") or {}).get("per_byte_s") for p in profiles]
    lines += ["", "| figure | " + " | ".join(f"cal {k + 1}" for k in range(n)) + " | spread | bootstrap sd (mean) |",
              "|---|" + "---|" * (n + 2)]
    for name in names:
        vals = [statistics.median(c[name]) if name in c else None for c in per_cal]
        got = [v for v in vals if v is not None]
        sds = [relative_sd(c[name]) for c in per_cal if name in c]
        scale = 1e3 if name.startswith("stall") else 1.0  # stall excess in ms
        doc["figures"][name] = {"values": vals, "bootstrap_sd": sds}
        # A stall excess sits near 0 (a signed median), so its spread is in ms, not relative.
        sp = f"{(max(got) - min(got)) * scale:.2f} ms" if name.startswith("stall") else f"{spread(got):.1%}"
        sd = f"{statistics.fmean(statistics.stdev(c[name]) for c in per_cal if name in c) * scale:.2f} ms" \
            if name.startswith("stall") else f"{statistics.fmean(sds):.1%}"
        lines.append(f"| {name} | " + " | ".join("-" if v is None else f"{v * scale:.3f}" for v in vals) +
                     f" | {sp} | {sd} |")
    # The fitted segments, which answer other group sizes and what-ifs (the table only answers the
    # calibrated one): the all-reduce's last segment's bus bandwidth and its segment count.
    for name, per in models.items():
        def last_bw(m) -> float:
            return m.fits[Op.ALL_REDUCE].segments[-1].bandwidth_Bps * 8 / 1e6

        vals = [last_bw(base) for base, _, _ in per]
        sds = [relative_sd(last_bw(m) for m in drawn) for _, drawn, _ in per]
        segs = [len(base.fits[Op.ALL_REDUCE].segments) for base, _, _ in per]
        doc["figures"][f"all_reduce_last_segment_Mbps_{name}"] = {"values": vals, "bootstrap_sd": sds, "segments": segs}
        lines.append(f"| all-reduce B of the last segment, Mbit/s ({name}; segments) | " +
                     " | ".join(f"{v:.1f} ({k})" for v, k in zip(vals, segs)) +
                     f" | {spread(vals):.1%} | {statistics.fmean(sds):.1%} |")
    if all(c is not None for c in cpu):
        doc["figures"]["cpu_per_byte_s"] = {"values": cpu}
        lines.append("| cpu_cost ns/B (no samples: one window a size) | " + " | ".join(f"{c * 1e9:.2f}" for c in cpu) +
                     f" | {spread(cpu):.1%} | - |")
    return doc, lines


def calibrate_all(mbit: int, count: int, folder: Path, t0: float, one_cluster: bool,
                  bucket_precision: float = BUCKET_PRECISION) -> tuple[Path, list[dict], list[Path]]:
    """``count`` calibrations at ``mbit`` Mbit/s, of one 2-node cluster (else each of its own); the topology file, the profiles and their files."""
    from neuronabox.cluster import runtime as rt

    topo_file = folder / f"rep{mbit}.yaml"
    topo_file.write_text(TOPO.format(mbit=mbit))
    topo = load_topology(topo_file)
    profiles, paths = [], []
    name = f"crep{mbit}" if one_cluster else None
    if name:
        rt.up(topo, runtime="netns", name=name)
    try:
        for k in range(count):
            doc_k = run_calibration(topo, [Op.ALL_REDUCE, Op.BROADCAST], default_sizes(4, 8 << 20, 2.0), cluster=name,
                                    bucket_precision=bucket_precision)
            path = folder / f"rep{mbit}-{k}.profile.json"
            save_profile(doc_k, path)
            profiles.append(json.loads(path.read_text()))
            paths.append(path)
            print(f"{mbit} Mbit/s: calibration {k + 1} done ({time.time() - t0:.0f} s, "
                  f"this one {doc_k['meta']['seconds']:.0f} s)", flush=True)
    finally:
        if name:
            rt.down(name)
    return topo_file, profiles, paths


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calibrations", type=int, default=5)
    ap.add_argument("--rates", default="100,300", help="Mbit/s, comma list")
    ap.add_argument("--draws", type=int, default=100, help="bootstrap draws per calibration")
    ap.add_argument("--from", dest="source", type=Path, help="re-analyse the profiles a results JSON holds (no root)")
    ap.add_argument("--out", default="calibration_repeat", help="results file name under benchmarks/results/")
    ap.add_argument("--cluster-each", action="store_true",
                    help="each calibration on a cluster of its own (default: all of a rate's on one cluster, as nbox "
                         "validate --calibrate calibrates the cluster its runs use)")
    ap.add_argument("--bucket-precision", default="0.5%",
                    help="nbox calibrate --bucket-precision of every calibration (finer: more samples from 256 KiB up)")
    ap.add_argument("--note", default="Measured on the shared 2-core VM while other engineers' sessions ran: the "
                                      "between-calibration spread includes their load.",
                    help="how busy the machine was, for the record")
    args = ap.parse_args()
    try:
        args.bucket_precision = parse_precision(args.bucket_precision, "--bucket-precision")
    except InputError as e:
        ap.error(str(e))
    t0 = time.time()
    rng = random.Random(20261203)  # the resampling is the same on every run of the same profiles
    old = json.loads(args.source.read_text()) if args.source else None
    cmd = (f".venv/bin/python benchmarks/calibration_repeat.py --from {args.source} --out {args.out}" if old else
           f"sudo .venv/bin/python benchmarks/calibration_repeat.py --calibrations {args.calibrations} "
           f"--rates {args.rates} --draws {args.draws} --out {args.out}" + (" --cluster-each" if args.cluster_each else "")
           + (f" --bucket-precision {f'{args.bucket_precision:.2%}' if args.bucket_precision else 'off'}"
              if args.bucket_precision != BUCKET_PRECISION else ""))
    doc: dict = {"command": cmd, "rates": {}}
    lines = ["# Calibration repeatability", "", f"`{cmd}`", "",
             args.note + (" Each calibration on a fresh cluster of its own." if args.cluster_each else
                          " A rate's calibrations on one cluster, one after the other.") +
             " The bootstrap and halves columns come from each profile's own samples and do "
             "not depend on the host's load. Per rate and workload: the modeled communication of one steady iteration (the sum of its "
             "collectives' modeled times) under each calibration's profile, with each size's time its samples' "
             "median (`median`, as calibrations before `settle_times` had it) and settled by its neighbours "
             "(`settled`, what `nbox calibrate` writes now); spread: (max-min)/median.", ""]
    with tempfile.TemporaryDirectory(prefix="nbox-calrep-") as tmp:
        folder = Path(tmp)
        rates = list(old["rates"]) if old else args.rates.split(",")
        for mbit in (int(x) for x in rates):
            if old:
                rd = old["rates"][str(mbit)]
                profiles = rd["profiles"]
                topo_file = folder / f"rep{mbit}.yaml"
                topo_file.write_text(TOPO.format(mbit=mbit))
                ops = {arch: [tuple(x) for x in w["ops"]] for arch, w in rd["workloads"].items()}
            else:
                topo_file, profiles, paths = calibrate_all(mbit, args.calibrations, folder, t0, not args.cluster_each,
                                                           args.bucket_precision)
                ops = {arch: workload_ops(topo_file, paths[0], arch, folder) for arch in ARCHS}
            topo = load_topology(topo_file)
            rate_doc, rate_lines = analyse(topo, profiles, ops, args.draws, rng)
            secs = [(p.get("meta") or {}).get("seconds") for p in profiles]
            counts = {r["size"]: len(r["samples"]) for r in profiles[0]["measurements"]["all_reduce"]}
            lines += [f"## {mbit} Mbit/s", "", *rate_lines, "",
                      "Calibration seconds: " + ", ".join(f"{s:.0f}" for s in secs if s is not None) + "; "
                      "all-reduce samples per size (cal 1): " +
                      ", ".join(f"{s >> 10 if s >= 1024 else s}{'K' if s >= 1024 else ''}:{c}" for s, c in counts.items()), ""]
            # Re-analysed profiles stay in their own file; new ones are kept here.
            doc["rates"][str(mbit)] = {**({"profiles_from": str(args.source)} if old else {"profiles": profiles}),
                                       **rate_doc}
    lines.append(f"({time.time() - t0:.0f} s in all)")
    OUT.mkdir(exist_ok=True)
    (OUT / f"{args.out}.md").write_text("\n".join(lines) + "\n")
    (OUT / f"{args.out}.json").write_text(json.dumps(doc, indent=1) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
