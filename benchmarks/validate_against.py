"""``nbox validate --against`` records of a netns stand-in testbed, beside ``nbox validate`` run on it directly.

The stand-in: a netns cluster of the topology (every rank in its node's namespace, gloo over
the shaped links), where each rank runs ``nbox record`` around the training command as a lab
machine would run it around torchrun. Interleaved, ``--rounds`` times: one record run, then one
direct validation (real system and model mode, one run each). Then ``validate --against`` all
records (model mode, the load twin as in the direct runs). Same table within the real system's
own spread is the goal.

    sudo .venv/bin/python benchmarks/validate_against.py [--rounds 5]   # -> benchmarks/results/validate_against.md
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from neuronabox.cluster import runtime as rt  # noqa: E402
from neuronabox.fidelity.validate import launch_real, run_validation  # noqa: E402
from neuronabox.topology import load_topology  # noqa: E402

TOPOLOGY = ROOT / "topologies" / "cpu-2x1g.yaml"
COMMAND = [sys.executable, str(ROOT / "examples" / "ddp_train.py"), "--steps", "40"]
OUT = ROOT / "benchmarks" / "results"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    t0 = time.time()
    topo = load_topology(TOPOLOGY)
    direct_real, direct_model, records = [], [], []
    with tempfile.TemporaryDirectory(prefix="nbox-against-") as tmp:
        for k in range(args.rounds):
            out = Path(tmp) / f"rec{k}"
            rt.up(topo, runtime="netns", name="vagainst")
            try:
                cmd = [sys.executable, "-m", "neuronabox.cli", "record", "-o", str(out), "--", *COMMAND]
                rc, codes = launch_real("vagainst", topo, cmd, record_only=False)
                if rc != 0:
                    raise SystemExit(f"record run {k} failed: {codes}")
            finally:
                rt.down("vagainst")
            records.append(out)
            v = run_validation(TOPOLOGY, COMMAND, modes=["model"], repeats=1, tolerance=1.0)
            direct_real.append(v.real.median_s)
            direct_model.append(v.modes[0].median_s)
            print(f"round {k + 1}: direct real {v.real.median_s * 1e3:.2f} ms, model {v.modes[0].median_s * 1e3:.2f} ms")
        against = run_validation(TOPOLOGY, COMMAND, modes=["model"], repeats=args.rounds, tolerance=1.0, against=records)
        recorded = [statistics.median(r) for r in against.real.runs]
    real_med, model_med = statistics.median(direct_real), statistics.median(direct_model)
    direct_err = model_med / real_med - 1
    spread = (max(direct_real) - min(direct_real)) / real_med
    rows = [
        ("direct: nbox validate (real system run here)", real_med, model_med, direct_err),
        ("--against: nbox record runs of the stand-in", against.real.median_s, against.modes[0].median_s,
         against.modes[0].error),
    ]
    lines = [
        "# `nbox validate --against` records beside `nbox validate` on the same testbed",
        "",
        f"`sudo .venv/bin/python benchmarks/validate_against.py --rounds {args.rounds}` ({time.time() - t0:.0f} s, the 2-core VM). "
        f"Topology `{TOPOLOGY.relative_to(ROOT)}` (netns stand-in of two lab machines), command "
        f"`{' '.join(Path(c).name if c.endswith('.py') else c for c in COMMAND[1:])}`; rounds interleave a record run and a direct validation.",
        "",
        "| how the real system was measured | real median (ms) | model median (ms) | model error |",
        "|---|---|---|---|",
    ]
    lines += [f"| {name} | {r * 1e3:.2f} | {m * 1e3:.2f} | {e:+.2%} |" for name, r, m, e in rows]
    lines += [
        "",
        f"Real system's own spread over the direct rounds: {spread:.2%} (per-round medians "
        f"{', '.join(f'{x * 1e3:.2f}' for x in direct_real)} ms); recorded per-run medians "
        f"{', '.join(f'{x * 1e3:.2f}' for x in recorded)} ms.",
        f"Difference of the two model errors: {abs(rows[1][3] - rows[0][3]):.2%} "
        f"({'within' if abs(rows[1][3] - rows[0][3]) <= spread else 'outside'} the real spread).",
    ]
    OUT.mkdir(exist_ok=True)
    (OUT / "validate_against.md").write_text("\n".join(lines) + "\n")
    (OUT / "validate_against.json").write_text(json.dumps({"direct_real": direct_real, "direct_model": direct_model,
                                                          "recorded": recorded, "against": against.as_dict()}, indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
