"""Do two calibrations of one cluster predict the same? Five calibrations at each rate, and what moves between them.

For each link rate: a 2-node netns cluster (1 rank each, gloo), ``--calibrations`` independent
``nbox calibrate`` sweeps (all-reduce and broadcast, 4 B to 8 MiB: what DDP runs), then for each
of the three ``examples/fidelity_models.py`` workloads the modeled communication of one steady
iteration (its collectives, as ``nbox run`` records them) under each profile. The spread of those
predictions is the calibration's own noise; the table also shows what moved: the fitted
segments (count, breakpoints) and the all-reduce time at the workload's bucket sizes.

    sudo .venv/bin/python benchmarks/calibration_repeat.py   # -> benchmarks/results/calibration_repeat.md
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from neuronabox.collectives import Op  # noqa: E402
from neuronabox.fidelity.calibrate import default_sizes, run_calibration  # noqa: E402
from neuronabox.fidelity.profile import save_profile  # noqa: E402
from neuronabox.model.calibrated import with_profile  # noqa: E402
from neuronabox.model.registry import create_model  # noqa: E402
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calibrations", type=int, default=5)
    ap.add_argument("--rates", default="100,300", help="Mbit/s, comma list")
    args = ap.parse_args()
    t0 = time.time()
    doc = {"rates": {}}
    lines = ["# Calibration repeatability", "",
             f"`sudo .venv/bin/python benchmarks/calibration_repeat.py --calibrations {args.calibrations}` on the 2-core VM.",
             "Per rate and workload: the modeled communication of one steady iteration (the sum of its collectives' "
             "modeled times) under each calibration's profile, and its spread (max-min over the median).", ""]
    with tempfile.TemporaryDirectory(prefix="nbox-calrep-") as tmp:
        folder = Path(tmp)
        for mbit in (int(x) for x in args.rates.split(",")):
            topo_file = folder / f"rep{mbit}.yaml"
            topo_file.write_text(TOPO.format(mbit=mbit))
            topo = load_topology(topo_file)
            profiles = []
            for k in range(args.calibrations):
                doc_k = run_calibration(topo, [Op.ALL_REDUCE, Op.BROADCAST], default_sizes(4, 8 << 20, 2.0))
                path = folder / f"rep{mbit}-{k}.profile.json"
                save_profile(doc_k, path)
                profiles.append(path)
                print(f"{mbit} Mbit/s: calibration {k + 1} done ({time.time() - t0:.0f} s)", flush=True)
            ops = {arch: workload_ops(topo_file, profiles[0], arch, folder) for arch in ARCHS}
            rate_doc = {"profiles": [json.loads(p.read_text()) for p in profiles], "workloads": {}}
            lines += [f"## {mbit} Mbit/s", "", "| workload | collectives / iteration | " +
                      " | ".join(f"cal {k + 1} (ms)" for k in range(len(profiles))) + " | spread |",
                      "|---|---|" + "---|" * (len(profiles) + 1)]
            for arch, seq in ops.items():
                preds = []
                for p in profiles:
                    model = create_model(with_profile(topo, p, None))
                    preds.append(sum(model.estimate(Op.parse(op), nbytes, range(2)).duration for op, nbytes in seq))
                med = statistics.median(preds)
                spread = (max(preds) - min(preds)) / med
                sizes = sorted({n for _, n in seq})
                lines.append(f"| {arch} | {len(seq)} ({', '.join(str(s) for s in sizes[-3:])} B) | "
                             + " | ".join(f"{x * 1e3:.3f}" for x in preds) + f" | {spread:.2%} |")
                rate_doc["workloads"][arch] = {"ops": seq, "predicted_s": preds, "spread": spread}
            lines += ["", "What the fits chose (all-reduce): segments and breakpoints per calibration:", ""]
            for k, prof in enumerate(rate_doc["profiles"]):
                fit = prof["ops"]["all_reduce"]
                segs = ", ".join(f"[{s['lo']:.0f}, {s['hi'] if s['hi'] is not None else 'inf'}): alpha {s['alpha_s'] * 1e6:.1f} us, "
                                 f"B {s['bandwidth_Bps'] * 8 / 1e6 if s['bandwidth_Bps'] else float('inf'):.1f} Mbit/s"
                                 for s in fit["segments"])
                lines.append(f"- cal {k + 1}: {len(fit['segments'])} segment(s): {segs}")
            lines.append("")
            doc["rates"][str(mbit)] = rate_doc
    lines.append(f"({time.time() - t0:.0f} s in all)")
    OUT.mkdir(exist_ok=True)
    (OUT / "calibration_repeat.md").write_text("\n".join(lines) + "\n")
    (OUT / "calibration_repeat.json").write_text(json.dumps(doc, indent=1) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
