"""Roles: the real system against nbox run with any single real rank plus role profiles (issue 27's table).

The command for the record (as root, on a quiet machine: nothing else running; 43 min on the
2-core development machine):

    .venv/bin/python benchmarks/roles.py --repeats 4 --steps 50

It writes ``benchmarks/results/roles.md`` and ``.json``. Other forms:

    .venv/bin/python benchmarks/roles.py --quick                       # smoke run: 2 repeats, 20 steps
    .venv/bin/python benchmarks/roles.py --workloads pp2-sendrecv --repeats 3 --out /tmp/cell.md

For each workload (examples/: a hand-written GPipe pipeline of 2 and 4 stages, the
torch.distributed.pipelining 1F1B schedule with 2 and 4 stages, a 4-expert MoE step with
uneven load), with stages or experts of unequal cost:

1. the first validation (rank 0's) records every role's program on its cluster (``nbox
   validate --roles``: one role per stage or expert rank, ``auto`` where torch tells the
   stages, rank sets otherwise), each role's rank under the load twin as the emulated runs
   will be (``--alone``: ``nbox profile``, each role alone on the machine), ``--profile-repeats``
   runs per role, each call's compute the median;
2. for every rank R of the world, ``nbox validate --rank R --role-profile DIR --modes
   model,real-again`` runs the real system (every rank real, each in its node's namespace of a
   netns cluster, gloo over the shaped 1 Gbit/s links, pinned round robin to the cores) and
   ``nbox run --rank R`` replaying the other roles, interleaved and repeated, with the load
   twin (the other ranks as their own replaying nbox runs on their cores);
3. the first workload is also validated without the profile (clones, as before roles), the
   baseline the roles correct.

The error is of the median iteration; ``real-again`` is the real system against itself, the
error a perfect emulator would read on this machine. Worlds of 4 ranks share this machine's
2 cores (two ranks a core, in the real system and in the twin), which a cluster never does.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PY = str(ROOT / ".venv" / "bin" / "python") if (ROOT / ".venv" / "bin" / "python").exists() else sys.executable
TOLERANCE = 0.03

TOPOLOGY = """\
name: roles-{n}x1g
description: {n} CPU nodes, 1 rank each, a 1 Gbps switch (the roles benchmark)
cluster: {{nodes: {n}, ranks_per_node: 1, device: cpu}}
intra_node: {{fabric: shm}}
network: {{type: switch, link: {{bandwidth: 1Gbps, latency: 100us}}}}
emulation: {{real_ranks: [0], library: gloo}}
"""

# name -> (world size, --roles, script and its arguments; the steps are appended). Pipelines: one
# role per stage, read from their stages (auto); the MoE step says nothing torch knows: one per rank.
WORKLOADS = {
    "pp2-sendrecv": (2, "0,1", ["examples/pipeline_sendrecv.py"]),
    "pp4-sendrecv": (4, "0,1,2,3", ["examples/pipeline_sendrecv.py"]),
    "pp2-1f1b": (2, "auto", ["examples/pipeline_schedule.py", "--schedule", "1f1b"]),
    "pp4-1f1b": (4, "auto", ["examples/pipeline_schedule.py", "--schedule", "1f1b"]),
    "moe4-uneven": (2, "0,1", ["examples/moe_alltoall.py", "--experts", "4"]),
}
BASELINE = ("pp2-sendrecv",)


def nbox(*args: str, log: Path) -> subprocess.CompletedProcess:
    """Run the nbox CLI; its output goes to ``log``."""
    cmd = [PY, "-m", "neuronabox.cli", *args]
    with open(log, "ab") as f:
        f.write(f"\n$ {shlex.join(cmd)}\n".encode())
        f.flush()
        return subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, check=False)


def validate(topo: Path, command: list[str], rank: int, profile: Path | None, repeats: int, work: Path,
             log: Path, record: list[str] = ()) -> dict:
    """One ``nbox validate`` of ``rank``: the real system, the emulated run, real-again (``record``: validate's
    ``--roles`` arguments, to record ``profile`` first)."""
    out = work / f"validate-{rank}-{'roles' if profile else 'clones'}.json"
    args = ["validate", str(topo), "--rank", str(rank), "--modes", "model,real-again", "--repeats", str(repeats),
            "--tolerance", f"{TOLERANCE:.0%}", "--json", str(out), *record]
    if profile is not None:
        args += ["--role-profile", str(profile)]
    r = nbox(*args, "--", *command, log=log)
    if not out.exists():
        raise SystemExit(f"nbox validate of rank {rank} failed (status {r.returncode}); see {log}")
    v = json.loads(out.read_text())
    modes = {m["mode"]: m for m in v["modes"]}
    return {
        "rank": rank,
        "roles": profile is not None,
        "real_median_s": v["real"]["median_s"],
        "real_spread": v["real_spread"],
        "model_median_s": modes["model"]["median_s"],
        "error": modes["model"]["error"],
        "interval": modes["model"]["interval"],
        "again_error": modes["real-again"]["error"],
        "iterations": v["iterations"],
        "seconds": v["seconds"],
    }


def run_workload(name: str, steps: int, repeats: int, profile_repeats: int, work: Path, log: Path,
                 alone: bool = False) -> dict:
    """Profile a workload's roles, then validate every rank with them (and the baseline without)."""
    world, spec, script = WORKLOADS[name]
    topo = work / f"topo{world}.yaml"
    topo.write_text(TOPOLOGY.format(n=world))
    command = [PY, *script, "--steps", str(steps)]
    prof = work / f"{name}-roles"
    t0 = time.perf_counter()
    if alone:
        r = nbox("profile", str(topo), "--roles", spec, "--repeats", str(profile_repeats), "-o", str(prof), "--",
                 *command, log=log)
        if r.returncode != 0:
            raise SystemExit(f"nbox profile of {name} failed (status {r.returncode}); see {log}")
        rows = [validate(topo, command, rank, prof, repeats, work, log) for rank in range(world)]
    else:
        # The first validation records the profile on its cluster, each role under the load twin.
        record = ["--roles", spec, "--role-repeats", str(profile_repeats)]
        rows = [validate(topo, command, 0, prof, repeats, work, log, record)]
        rows += [validate(topo, command, rank, prof, repeats, work, log) for rank in range(1, world)]
    roles = json.loads((prof / "profile.json").read_text())["roles"]
    if name in BASELINE:
        rows += [validate(topo, command, rank, None, repeats, work, log) for rank in range(world)]
    for row in rows:
        print(f"{name} rank {row['rank']} {'roles ' if row['roles'] else 'clones'}: real "
              f"{row['real_median_s'] * 1e3:.2f} ms, nbox {row['model_median_s'] * 1e3:.2f} ms, error "
              f"{row['error']:+.2%} (real-again {row['again_error']:+.2%})", flush=True)
    return {"workload": name, "world": world, "command": command, "roles": roles["roles"], "spec": roles["spec"],
            "rows": rows, "seconds": time.perf_counter() - t0}


def render(doc: dict) -> str:
    """The Markdown table of a run."""
    lines = [
        "# Roles: the real system against nbox run with one real rank and role profiles",
        "",
        f"Command: `{doc['command']}`  ",
        f"Date: {doc['date']}; machine: {doc['machine']}; load average before {doc['load_before']}, "
        f"after {doc['load_after']}.  ",
        f"{doc['repeats']} interleaved runs of each system per row, {doc['steps']} steps a run (the first left out), "
        f"profiles of {doc['profile_repeats']} runs per role, recorded {doc.get('profiled', 'alone')}; 1 Gbit/s 100 us links (netns, tbf, the delay relay); "
        "real system: gloo, every rank real, pinned round robin to the 2 cores; nbox: model mode, alpha-beta, "
        "the load twin on.",
        "",
        "| workload | ranks | real rank | emulated as | real (ms) | nbox (ms) | error | 95% interval | real-again "
        "| real spread | within 3% |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for w in doc["workloads"]:
        for r in w["rows"]:
            lo, hi = r["interval"] or (r["error"], r["error"])
            ok = "yes" if abs(r["error"]) <= TOLERANCE else "no"
            lines.append(
                f"| {w['workload']} | {w['world']} | {r['rank']} | {'roles' if r['roles'] else 'clones (no profile)'} "
                f"| {r['real_median_s'] * 1e3:.2f} | {r['model_median_s'] * 1e3:.2f} | {r['error']:+.2%} "
                f"| {lo:+.1%}..{hi:+.1%} | {r['again_error']:+.2%} | {r['real_spread']:.1%} | {ok} |")
    lines += ["", "Roles per workload:", ""]
    for w in doc["workloads"]:
        lines.append(f"- {w['workload']}: {w['spec']}: "
                     + "; ".join(f"{n} = ranks {', '.join(map(str, rs))}" for n, rs in w["roles"].items())
                     + f" (`{' '.join(w['command'][1:])}`)")
    lines.append("")
    return "\n".join(lines)


def main() -> None:
    """Run the table."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workloads", default=",".join(WORKLOADS), help="Comma-separated: " + ", ".join(WORKLOADS))
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--profile-repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--quick", action="store_true", help="2 repeats, 20 steps, 1 profiling run per role")
    p.add_argument("--alone", action="store_true",
                   help="profile with nbox profile (each role alone on the machine), not under the load twin")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "roles.md")
    args = p.parse_args()
    if args.quick:
        args.repeats, args.steps, args.profile_repeats = 2, 20, 1
    names = [w.strip() for w in args.workloads.split(",") if w.strip()]
    for n in names:
        if n not in WORKLOADS:
            raise SystemExit(f"--workloads: unknown workload {n!r} (choose from {', '.join(WORKLOADS)})")
    if os.geteuid() != 0:
        raise SystemExit("the real system runs in network namespaces: run as root")
    doc = {
        "command": shlex.join([".venv/bin/python", "benchmarks/roles.py", *sys.argv[1:]]),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{platform.node()} ({os.cpu_count()} cores, {platform.machine()}, kernel {platform.release()})",
        "load_before": " ".join(f"{x:.2f}" for x in os.getloadavg()),
        "repeats": args.repeats, "steps": args.steps, "profile_repeats": args.profile_repeats,
        "profiled": "alone (nbox profile)" if args.alone else "under the load twin (nbox validate --roles)",
        "workloads": [],
    }
    with tempfile.TemporaryDirectory(prefix="nbox-roles-bench-") as tmp:
        work = Path(tmp)
        log = args.out.with_suffix(".log")
        log.unlink(missing_ok=True)
        for name in names:
            doc["workloads"].append(run_workload(name, args.steps, args.repeats, args.profile_repeats, work, log,
                                                 args.alone))
            doc["load_after"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
            args.out.with_suffix(".json").write_text(json.dumps(doc, indent=1) + "\n")
            args.out.write_text(render(doc))
    print(f"wrote {args.out} and {args.out.with_suffix('.json')} (log {log})")


if __name__ == "__main__":
    main()
