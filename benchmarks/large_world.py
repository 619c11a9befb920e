"""Time and memory of the verbs on worlds at the bounds (issue 31: world <= 10 M ranks, <= 1,024 a node).

Each case is a fresh process (``nbox ...`` or ``python -c``), measured from outside: wall time and
peak resident memory (``ru_maxrss`` of the finished child). The worlds:

- ``10M-rail``: 10,000 nodes x 1,000 ranks, rail-optimized, 8 NICs a node (10 M ranks);
- ``10M-fat-tree``: 10,000 nodes x 1,000 ranks, fat-tree, one NIC a node;
- ``1M-switch``: 1,024 nodes x 1,024 ranks behind one switch (the world measured at 44.5 s, 3.1 GB
  before the lazy graph);
- ``whatif-10M``: a two-node file of 1,000 ranks a node grown by ``--world-size 10000000``.

Verbs: ``load`` (schema and resolution, what ``nbox validate``-style loading costs), ``show``,
``show --route 0:<last>``, ``run`` (model-mode planning until the script starts: the script is
``true``), ``run-allreduce`` (the script calls ``init_process_group`` and one ``all_reduce``, so the
emulator builds its model, world tables and the world group's tables in the child too; its peak is
the largest of the processes; torch's own ``init_process_group`` makes a dict of every rank, about
5 s and 0.9 GB of it at 10 M), ``estimate`` (the file's model, the first all-reduce over the world,
in one process) and ``show-dot`` (refused for a lazy world: one line, exit 2).
Target: seconds and under 1 GB each. Run: ``.venv/bin/python benchmarks/large_world.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
NBOX = str(Path(PY).parent / "nbox")

WORLDS = {
    "10M-rail": ("cluster: {nodes: 10000, ranks_per_node: 1000, device: H100}\n"
                 "intra_node: {fabric: nvlink, bandwidth: 450GB/s, latency: 1us}\n"
                 "network: {type: rail-optimized, nics_per_node: 8, link: {bandwidth: 400Gbps, latency: 1us},"
                 " switch_latency: 600ns}\n"
                 "emulation: {library: nccl, model: nccl, real_ranks: [0]}\n"),
    "10M-fat-tree": ("cluster: {nodes: 10000, ranks_per_node: 1000}\n"
                     "network: {type: fat-tree, link: {bandwidth: 100Gbps, latency: 1us}}\n"
                     "emulation: {library: gloo, model: alpha-beta, real_ranks: [0]}\n"),
    "1M-switch": ("cluster: {nodes: 1024, ranks_per_node: 1024}\n"
                  "network: {type: switch, link: {bandwidth: 100Gbps, latency: 5us}}\n"
                  "emulation: {library: gloo, model: alpha-beta, real_ranks: [0]}\n"),
    "whatif-10M": ("cluster: {nodes: 2, ranks_per_node: 1000}\n"
                   "network: {type: switch, link: {bandwidth: 100Gbps, latency: 5us}}\n"
                   "emulation: {library: gloo, model: alpha-beta, real_ranks: [0]}\n"),
}
INIT_SCRIPT = ("import torch, torch.distributed as dist; dist.init_process_group('gloo'); x = torch.ones(4); "
               "dist.all_reduce(x); print('world', dist.get_world_size(), 'sum', x[0].item()); "
               "dist.destroy_process_group()")
ESTIMATE = ("import sys, time; from neuronabox.topology import load_topology; "
            "from neuronabox.topology.whatif import apply_whatif_flags; "
            "from neuronabox.model.registry import create_model; from neuronabox.collectives import Op; "
            "ws = int(sys.argv[2]) if len(sys.argv) > 2 else None; "
            "m = create_model(apply_whatif_flags(load_topology(sys.argv[1]), world_size=ws)); t = time.monotonic(); "
            "e = m.estimate(Op.ALL_REDUCE, 1 << 26, m.world()); "
            "print(m.name, e, f'first estimate {time.monotonic() - t:.2f} s')")


def verbs(path: str, world: int, extra: list[str]) -> dict[str, list[str]]:
    """The command of each measured verb on the topology file ``path``."""
    load = ("import sys; from neuronabox.topology import load_topology; "
            "t = load_topology(sys.argv[1]); print(t.world_size, len(t.nodes))")
    out = {
        "load": [PY, "-c", load, path],
        "show": [NBOX, "show", path, *extra],
        "show-route": [NBOX, "show", path, "--route", f"0:{world - 1}", *extra],
        "run": [NBOX, "run", path, "-q", *extra, "--", "true"],
        "run-allreduce": [NBOX, "run", path, "-q", *extra, "--", PY, "-c", INIT_SCRIPT],
        "estimate": [PY, "-c", ESTIMATE, path, *extra[1:]],
        "show-dot": [NBOX, "show", path, "--dot", os.devnull, *extra],
    }
    if extra:  # a what-if load: the flag is merged the way the CLI merges it
        out["load"] = [PY, "-c", load.replace("load_topology(sys.argv[1])",
                                              "apply_whatif_flags(load_topology(sys.argv[1]), world_size=int(sys.argv[2]))")
                       .replace("import load_topology", "import load_topology; from neuronabox.topology.whatif import apply_whatif_flags"),
                       path, extra[1]]
    return out


# A fresh wrapper per command: RUSAGE_CHILDREN of a process is the largest of every descendant it
# (or they) waited for, so this one's figure is the command's alone (nbox and its script).
_WRAP = ("import resource, subprocess, sys; p = subprocess.run(sys.argv[1:]); "
         "print('peak_kb', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr); "
         "sys.exit(p.returncode)")


def measure(cmd: list[str], timeout: float) -> dict:
    """Wall seconds, peak RSS (MB) of the command's processes, exit code and the last output line."""
    t0 = time.monotonic()
    try:
        p = subprocess.run([PY, "-c", _WRAP, *cmd], capture_output=True, text=True, timeout=timeout, cwd=ROOT)
        rc, text = p.returncode, (p.stdout + p.stderr).strip()
    except subprocess.TimeoutExpired:
        rc, text = "timeout", ""
    took = time.monotonic() - t0
    lines = text.splitlines()
    peak = next((int(x.split()[1]) for x in lines if x.startswith("peak_kb ")), None)
    lines = [x for x in lines if not x.startswith("peak_kb ")]
    return {"seconds": round(took, 2), "peak_mb": round(peak / 1024) if peak else None,
            "rc": rc, "lines": len(lines), "last_line": lines[-1][:160] if lines else ""}


def main() -> int:
    """Measure every verb on every world and write the result file."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--worlds", default=",".join(WORLDS))
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "large_world.json"))
    args = ap.parse_args()
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="nbox-large-") as tmp:
        for name in args.worlds.split(","):
            path = Path(tmp) / f"{name}.yaml"
            path.write_text(WORLDS[name])
            extra = ["--world-size", "10000000"] if name == "whatif-10M" else []
            world = 10_000_000 if extra else None
            if world is None:
                from neuronabox.topology import load_topology

                world = load_topology(path).world_size
            results[name] = {"world": world}
            for verb, cmd in verbs(str(path), world, extra).items():
                r = measure(cmd, args.timeout)
                results[name][verb] = r
                print(f"{name:13} {verb:10} {r['seconds']:7.2f} s  peak {r['peak_mb']} MB  rc {r['rc']}  "
                      f"{r['last_line'][:70]}", flush=True)
    doc = {
        "what": "issue 31: wall time and peak RSS of loading, show, show --route, nbox run (model mode, until "
                "the script starts; and through init_process_group and one all_reduce) and the first world "
                "all-reduce estimate on worlds at the bounds",
        "command": " ".join([Path(PY).name, *sys.argv]),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs (shared), {platform.python_implementation()} "
                   f"{platform.python_version()}",
        "note": "peak_mb: the largest resident set of the command's processes (ru_maxrss of a wrapper's children)",
        "worlds": results,
    }
    Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
