"""Where an emulated DDP step differs from the real one: per-phase and per-bucket times, real vs emulated (root only).

The fidelity table says by how much an emulated iteration differs; this says where. On one
2-node cluster of the table's kind (a network of ``fidelity_table.NETWORKS``), it runs a
workload of ``examples/fidelity_models.py`` with ``--bucket-log`` (DDP's stock all-reduce hook,
timed) as the real system and emulated, in interleaved rounds, and prints per system the
medians of: the iteration, the forward (zero_grad to loss), each gradient bucket's issue time
(from the end of the forward) and all-reduce time (issue to completion, as the step sees it),
when all buckets are done after the first was issued, and the optimizer step. ``--env`` runs
model mode (or the mode it names) again with a diagnostic switch set, for A/B runs
(``--env NBOX_FOOTPRINT=0``, ``--env wire:NAME=VALUE``). ``--keep DIR`` keeps the profile, the
bucket logs and the emulated runs' reports, whose per-op records (ready, start, stall, end) say
how the timeline placed each bucket.

    sudo .venv/bin/python benchmarks/bucket_timeline.py --network 10Gbit-10us --arch mlp --rounds 3
    sudo .venv/bin/python benchmarks/bucket_timeline.py --network 10Gbit-10us --arch mlp \\
        --profile /tmp/p.json --modes model,wire --env NBOX_FOOTPRINT=0 --json /tmp/buckets.json

Found with it (session 10, 10 Gbit/s MLP): the real second bucket is issued 0.5-0.8 ms after
the first, model mode's 2.3-2.6 ms after (the footprint spends the first's CPU beside the
backward), 0.5-0.8 with ``NBOX_FOOTPRINT=0``; the buckets end 3.7-5.5 ms after the first's issue
in the real system, 5.0-5.4 in model mode: the iteration agrees for two errors that cancel.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from fidelity_table import NETWORKS as TABLE_NETWORKS, TOPOLOGY, calibrate  # noqa: E402  (the table's clusters and calibration)

# The table's networks and validate_repeat.py's (300 and 100 Mbit/s, 100 us; model mode read 3-7 % fast at 300).
NETWORKS = {**TABLE_NETWORKS, "300Mbit-100us": ("300Mbps", "100us"), "100Mbit-100us": ("100Mbps", "100us")}


def phases(log: dict, warmup: int) -> dict[str, float]:
    """Medians over one rank's measured steps: iteration, forward, each bucket's issue and time, all done, step."""
    rows: dict[str, list[float]] = {}
    buckets = sorted(log["buckets"], key=lambda b: b[1])
    for t0, t1, t2, t3 in log["steps"][warmup:]:
        mine = [b for b in buckets if t1 <= b[1] <= t2]
        vals = {"iteration": t3 - t0, "forward": t1 - t0, "step": t3 - t2}
        for i, (nbytes, issued, done) in enumerate(mine):
            vals[f"bucket {i} issued"] = issued - t1
            vals[f"bucket {i} all-reduce"] = done - issued
        if mine:
            vals["all done after the first issue"] = max(b[2] for b in mine) - mine[0][1]
        for k, v in vals.items():
            rows.setdefault(k, []).append(v)
    return {k: statistics.median(v) for k, v in rows.items()}


def workload_args(p: argparse.ArgumentParser, network: str) -> None:
    """The arguments of the diagnostics that run a workload on one cluster: its network, the workload, the rounds."""
    p.add_argument("--network", default=network, choices=list(NETWORKS))
    p.add_argument("--arch", default="mlp", choices=["mlp", "cnn", "transformer"])
    p.add_argument("--rounds", type=int, default=3, help="interleaved runs of each system")
    p.add_argument("--steps", type=int, default=25)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--no-peer-noise", dest="peer_noise", action="store_false",
                   help="the topology without peer noise (as validate_repeat.py's)")


def parse_workload_args(p: argparse.ArgumentParser, prog: str) -> argparse.Namespace | None:
    """Parse a workload diagnostic's arguments; None (said on stderr) without root. SIGTERM exits, so the cluster comes down."""
    args = p.parse_args()
    if os.geteuid() != 0:
        print(f"{prog}: needs root (the real system runs in network namespaces)", file=sys.stderr)
        return None
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    return args


@contextlib.contextmanager
def workload_cluster(network: str, short: str, peer_noise: bool = True):
    """A 2-node netns cluster of the table's kind and a scratch folder: (folder, topology file, topology, name)."""
    from neuronabox.cluster import runtime as rt
    from neuronabox.topology import load_topology

    bw, lat = NETWORKS[network]
    with tempfile.TemporaryDirectory(prefix=f"nbox-{short}-") as tmp:
        tmpd = Path(tmp)
        os.environ.setdefault("NBOX_STATE_DIR", str(tmpd / "state"))
        topo_file = tmpd / "topology.yaml"
        topo_file.write_text(TOPOLOGY.format(key=network.lower(), bw=bw, lat=lat, noise=str(peer_noise).lower()))
        topo = load_topology(topo_file)
        name = f"{short}{os.getpid() % 10000}"
        up = rt.up(topo, runtime="netns", name=name)
        try:
            yield tmpd, topo_file, topo, name
        finally:
            if not up.already_up:
                rt.down(name)


def run_workload(cluster, args, log: Path, mode: str, profile: Path | None, env: dict | None = None):
    """One run of the workload with its bucket log, real (mode ``real``) or emulated: (status, phases or None)."""
    from neuronabox.fidelity.validate import _run_emulated, launch_real, rank_cores, twin_ranks

    tmpd, topo_file, topo, name = cluster
    cmd = [sys.executable, str(ROOT / "examples" / "fidelity_models.py"), "--arch", args.arch,
           "--steps", str(args.steps), "--bucket-log", str(log)]
    if mode == "real":
        rc, _ = launch_real(name, topo, cmd, None, record_only=False)
    else:
        (tmpd / "report.json").unlink(missing_ok=True)  # a failed run must not leave the last one's to keep
        with mock.patch.dict(os.environ, env or {}):  # the emulated run and its twin inherit it
            rc = _run_emulated(topo_file, cmd, mode, tmpd / "report.json", rank_cores(topo.world_size)[0], name,
                               None, profile, tmpd / "emulated.log", 300.0, twins=twin_ranks(topo.world_size, 0))
    got = Path(f"{log}.rank0.json")
    if rc != 0 or not got.exists():
        return rc, None
    return rc, phases(json.loads(got.read_text()), args.warmup)


def keep_run(tmpd: Path, log: Path, to: Path, mode: str) -> None:
    """Copy one run's bucket logs (every rank's) and, for an emulated run, its report next to ``to``."""
    for got in tmpd.glob(f"{log.name}.rank*.json"):
        shutil.copy(got, to.with_name(to.name + got.name[len(log.name):]))
    if mode != "real" and (tmpd / "report.json").exists():
        shutil.copy(tmpd / "report.json", to.with_name(to.name + ".report.json"))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    workload_args(p, "10Gbit-10us")
    p.add_argument("--modes", default="model", help="emulated modes to run beside the real system: model, wire")
    p.add_argument("--env", action="append", default=[], metavar="[MODE:]NAME=VALUE",
                   help="also run model mode (or MODE) with this environment variable set (repeatable)")
    p.add_argument("--profile", type=Path, help="a calibration profile for this network (default: calibrate first)")
    p.add_argument("--calibrate-sizes", default="4B:64MiB", help="the sizes the calibration sweeps (validate_repeat.py: 4B:8MiB)")
    p.add_argument("--json", type=Path, help="write every run's phases here")
    p.add_argument("--keep", type=Path, help="keep the profile, each run's bucket log and each emulated run's "
                   "report (its per-op records: start, stall, end) in this folder")
    args = parse_workload_args(p, "bucket_timeline")
    if args is None:
        return 2
    from neuronabox.fidelity.profile import save_profile

    # (label, mode, environment it adds): the real system, each mode, each --env run.
    runners = [("real", "real", {})] + [(m, m, {}) for m in (m.strip() for m in args.modes.split(",")) if m]
    for e in args.env:
        mode, _, kv = e.partition(":") if ":" in e.split("=", 1)[0] else ("model", "", e)
        key, _, value = kv.partition("=")
        runners.append((f"{mode} {kv}", mode, {key: value}))
    systems = [label for label, _, _ in runners]
    runs: dict[str, list[dict[str, float]]] = {s: [] for s in systems}
    with workload_cluster(args.network, "bkt", args.peer_noise) as cluster:
        tmpd, _, topo, name = cluster
        profile = args.profile
        if profile is None:
            t0 = time.perf_counter()
            profile = tmpd / "profile.json"
            save_profile(calibrate(topo, name, args.calibrate_sizes), profile)
            print(f"calibrated in {time.perf_counter() - t0:.0f} s", flush=True)
        if args.keep:
            args.keep.mkdir(parents=True, exist_ok=True)
            shutil.copy(profile, args.keep / "profile.json")
        for rnd in range(args.rounds):
            for i, (system, mode, env) in enumerate(runners):
                rc, ph = run_workload(cluster, args, tmpd / f"{rnd}-{i}", mode, profile, env)
                if args.keep:
                    keep_run(tmpd, tmpd / f"{rnd}-{i}", args.keep / f"{rnd}-{i}", mode)
                if ph is None:
                    print(f"round {rnd + 1} {system}: failed (status {rc})", file=sys.stderr)
                    continue
                runs[system].append(ph)
                print(f"round {rnd + 1} {system}: iteration {ph['iteration'] * 1e3:.2f} ms", flush=True)
    keys = list(runs["real"][0]) if runs["real"] else []
    print(f"\n{args.network} {args.arch}: medians over the rounds of each run's medians "
          "(ms; bucket issue times from the end of the forward)")
    widths = [max(10, len(s) + 2) for s in systems]
    print(f"{'':32}" + "".join(f"{s:>{w}}" for s, w in zip(systems, widths)))
    for k in keys:
        cells = [statistics.median(r[k] for r in runs[s] if k in r) * 1e3 if any(k in r for r in runs[s]) else None
                 for s in systems]
        print(f"{k:32}" + "".join(f"{c:{w}.2f}" if c is not None else f"{'-':>{w}}" for c, w in zip(cells, widths)))
    if args.json:
        args.json.write_text(json.dumps({"network": args.network, "arch": args.arch, "runs": runs}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
