"""Roles at scale: `nbox run --role-profile` start-up and per-op CPU in a 1,024-rank world vs a 2-rank one.

Requirement (roles issue): "A 1,024-rank world with 4 roles: `nbox run` start-up and
per-collective CPU within 10% of a 2-rank world's; profile files independent of world size."
The replay's cost must be O(roles), not O(world).

The workload (written to a temp folder with the topologies): a pipeline over a DeviceMesh
``init_device_mesh("cpu", (pp, dp), mesh_dim_names=("pp", "dp"))``, pp outermost; each
iteration every stage sends activations forward and gradients backward with blocking
``dist.send``/``dist.recv`` on ``mesh["pp"].get_group()`` (4 micro-batches), all-reduces its
gradients over ``mesh["dp"]`` and takes an SGD step. One 16x16 linear layer per stage, so the
emulator's own cost dominates the real rank's CPU. Worlds (``--worlds RANKS:PP,...``, one rank
per node on a 10 Gbit/s switch): 2 ranks with pp=2, dp=1 (2 roles), 8 ranks with pp=4, dp=2
(4 roles: the same roles as 1,024, a control that tells roles from world size) and 1,024
ranks with pp=4, dp=256 (4 roles).

For each world:

1. ``nbox profile TOPO --roles pp --mesh pp=P,dp=D -o DIR -- python train.py`` records the
   roles; reported: the folder's bytes, each role file's bytes, calls and bytes per call, and
   whether a role file makes the same calls (gaps and payload values aside) as the same role's
   file in the other worlds.
2. ``nbox run TOPO --rank 0 --role-profile DIR -q --report R.json -- python train.py``,
   ``--repeats`` times, the worlds interleaved (order rotated each repeat); per run:
   start-up = wall time from launching ``nbox run`` until the script's first iteration
   begins (it prints a ``time.time()`` stamp right after ``init_device_mesh``; the launch
   stamp is taken here just before the process starts), and until the first iteration ends;
   per-op CPU = the real rank's ``time.process_time()`` (all its threads) over the steady
   iterations (after ``--warmup``) divided by the ops it issued in them, also without the time
   spent in Python's garbage collector (a full collection costs ~0.15-0.3 s with torch loaded;
   whether one falls in the window swings CPU/op by ~100 us). The report is checked:
   its ops are the script's, every other role was replayed, no op was forced.
   Medians over the repeats; 1,024 vs 2 (the requirement) and 1,024 vs 8 (world size alone).

``--cprofile DIR`` adds, per world, a cProfile of the real rank's steady iterations (the script
profiles itself when ``ROLES_SCALE_CPROFILE`` is set, which the profile's command digest does
not see) and of start-up (``nbox run`` under cProfile, and the script under ``python -m
cProfile``, replaying a profile recorded for that command), and prints the functions whose
own time grows most from each smaller world to the largest (blocking calls left out).

Each world is also run without ``--role-profile`` (all clones, ``--no-clones`` skips it): the
start-up that world size costs without roles.

Run: `.venv/bin/python benchmarks/roles_scale.py` (about 6 minutes on the 2-core machine; the
recorded table: `--repeats 7 --cprofile /tmp/roles_scale_prof`, about 8 minutes);
writes benchmarks/results/roles_scale.md and .json and prints the tables.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import pstats
import resource
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable

TOPOLOGY = """\
name: roles-scale-{ranks}
description: {nodes} CPU nodes x {rpn} rank(s) on one 10 Gbps switch (benchmarks/roles_scale.py)
cluster:
  nodes: {nodes}
  ranks_per_node: {rpn}
  device: cpu
intra_node:
  fabric: shm
network:
  type: switch
  link:
    bandwidth: 10Gbps
    latency: 10us
emulation:
  real_ranks: [0]
  library: gloo
  model: alpha-beta
"""

SCRIPT = '''\
"""roles_scale workload: pp stages over a DeviceMesh exchange activations and gradients; dp all-reduce."""
import time
T_START = time.time()
import argparse
import gc
import json
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

p = argparse.ArgumentParser()
p.add_argument("--pp", type=int, required=True)
p.add_argument("--iters", type=int, default=200)
p.add_argument("--warmup", type=int, default=20)
p.add_argument("--mb", type=int, default=4, help="micro-batches")
p.add_argument("--hidden", type=int, default=16)
a = p.parse_args()
PROF = os.environ.get("ROLES_SCALE_CPROFILE")  # steady-state cProfile of this rank (not in the command digest)
GC = {"on": False, "s": 0.0, "full": 0, "t": 0.0}  # garbage collections in the steady iterations


def gc_watch(phase, info):
    if GC["on"]:
        if phase == "start":
            GC["t"] = time.perf_counter()
        else:
            GC["s"] += time.perf_counter() - GC["t"]
            GC["full"] += info["generation"] == 2


gc.callbacks.append(gc_watch)
torch.set_num_threads(1)
dist.init_process_group("gloo")
world = dist.get_world_size()
pp, dp = a.pp, world // a.pp
mesh = init_device_mesh("cpu", (pp, dp), mesh_dim_names=("pp", "dp"))
t_mesh, cpu_mesh = time.time(), time.process_time()
full_before_mesh = gc.get_stats()[2]["collections"]  # full collections so far (start-up)
ppg, dpg = mesh["pp"].get_group(), mesh["dp"].get_group()
s = mesh.get_local_rank("pp")
first, last = s == 0, s == pp - 1
torch.manual_seed(s)  # the same weights in every dp replica of a stage
layer = torch.nn.Linear(a.hidden, a.hidden)
params = list(layer.parameters())
opt = torch.optim.SGD(params, lr=0.01)
shape = (2, a.hidden)
data = torch.randn(a.mb, *shape)
ops = 0
t_first = cpu0 = wall0 = ops0 = prof = None
for it in range(a.iters):
    if it == a.warmup:
        cpu0, wall0, ops0 = time.process_time(), time.perf_counter(), ops
        GC["on"] = True
        if PROF:
            import cProfile
            prof = cProfile.Profile()
            prof.enable()
    opt.zero_grad()
    ins, outs = [], []
    for i in range(a.mb):  # forward
        if first:
            x = data[i]
        else:
            x = torch.empty(shape)
            dist.recv(x, group=ppg, group_src=s - 1)
            ops += 1
            x.requires_grad_()
        y = layer(x)
        if last:
            y = y.square().mean()
        else:
            dist.send(y.detach(), group=ppg, group_dst=s + 1)
            ops += 1
        ins.append(x)
        outs.append(y)
    for i in range(a.mb):  # backward
        if last:
            outs[i].backward()
        else:
            g = torch.empty(shape)
            dist.recv(g, group=ppg, group_src=s + 1)
            ops += 1
            outs[i].backward(g)
        if not first:
            dist.send(ins[i].grad, group=ppg, group_dst=s - 1)
            ops += 1
    for prm in params:  # data parallel over the dp group
        dist.all_reduce(prm.grad, group=dpg)
        ops += 1
        prm.grad /= dp
    opt.step()
    if it == 0:
        t_first = time.time()
cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
GC["on"] = False
if prof is not None:
    prof.disable()
    prof.dump_stats(PROF)
print("ROLES_SCALE " + json.dumps({"t_start": T_START, "t_mesh": t_mesh, "cpu_mesh": cpu_mesh, "t_first": t_first, "ops": ops,
                                   "steady_ops": ops - ops0, "steady_iters": a.iters - a.warmup,
                                   "cpu_s": cpu, "wall_s": wall, "gc_s": GC["s"], "gc_full": GC["full"],
                                   "full_gc_before_mesh": full_before_mesh}), flush=True)
dist.destroy_process_group()
'''


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    env.pop("ROLES_SCALE_CPROFILE", None)
    return env


def _nbox(*args: str, env: dict | None = None, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run([PY, "-m", "neuronabox.cli", *args], capture_output=True, text=True, cwd=ROOT,
                          env=env or _env(), check=check)


def _grab(stdout: str) -> dict:
    for line in stdout.splitlines():
        if line.startswith("ROLES_SCALE "):
            return json.loads(line[len("ROLES_SCALE "):])
    raise RuntimeError(f"no ROLES_SCALE line in the output:\n{stdout[-3000:]}")


class World:
    """One world: its topology, pipeline depth, the command and its role profile."""

    def __init__(self, ranks: int, pp: int, rpn: int, tmp: Path, args):
        if ranks % pp or ranks % rpn:
            raise SystemExit(f"--worlds: {ranks} ranks do not split into pp={pp} or {rpn} ranks per node")
        self.ranks, self.pp, self.dp = ranks, pp, ranks // pp
        self.name = f"{ranks} ranks (pp={pp}, dp={self.dp})"
        self.topo = tmp / f"roles-scale-{ranks}.yaml"
        self.topo.write_text(TOPOLOGY.format(ranks=ranks, nodes=ranks // rpn, rpn=rpn))
        self.script = tmp / "train.py"
        self.args = ["--pp", str(pp), "--iters", str(args.iters), "--warmup", str(args.warmup)]
        self.command = [PY, str(self.script), *self.args]
        self.profile = tmp / f"profile-{ranks}"
        self.tmp = tmp

    def record(self, command=None, out: Path | None = None) -> float:
        """``nbox profile`` of ``command`` (default: the workload) into ``out``; seconds taken."""
        t0 = time.perf_counter()
        _nbox("profile", str(self.topo), "--roles", "pp", "--mesh", f"pp={self.pp},dp={self.dp}",
              "-o", str(out or self.profile), "--", *(command or self.command))
        return time.perf_counter() - t0

    def files(self) -> dict:
        """Bytes of the profile folder and, per role file, its bytes, calls and call signature."""
        out = {"total_bytes": 0, "manifest_bytes": 0, "roles": {}}
        for f in sorted(self.profile.iterdir()):
            size = f.stat().st_size
            out["total_bytes"] += size
            if f.name == "profile.json":
                out["manifest_bytes"] = size
            elif f.name.startswith("role-") and f.name.endswith(".json"):
                doc = json.loads(f.read_text())
                ev = doc["events"]
                calls = sum(1 for e in ev if e[0] == "op")
                # What the role does, without the compute gaps and sent values (which vary run to run).
                sig = json.dumps([[e[0]] + list(e[2:7]) for e in ev])
                out["roles"][doc["role"]] = {"bytes": size, "events": len(ev), "calls": calls,
                                             "bytes_per_call": size / max(calls, 1), "groups": doc["groups"],
                                             "signature": sig}
        return out

    def run(self, report: Path, roles: bool = True) -> dict:
        """One run of the real rank 0 (replaying the roles, or all clones): start-up, steady CPU per op, checks."""
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        replay = ["--role-profile", str(self.profile)] if roles else []
        launch = time.time()
        p = subprocess.run([PY, "-m", "neuronabox.cli", "run", str(self.topo), "--rank", "0", *replay,
                            "-q", "--report", str(report), "--", *self.command],
                           capture_output=True, text=True, cwd=ROOT, env=_env(), check=False)
        end = time.time()
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        if p.returncode:
            raise RuntimeError(f"nbox run ({self.name}) exited {p.returncode}:\n{p.stderr[-3000:]}")
        s = _grab(p.stdout)
        rep = json.loads(report.read_text())
        roles = rep.get("roles") or {}
        replayed = {k: v for k, v in roles.items() if isinstance(v, dict) and not v.get("real", False)
                    and not k.startswith("_")}
        problems = []
        if len(rep.get("ops", [])) != s["ops"]:
            problems.append(f"report has {len(rep.get('ops', []))} ops, the script issued {s['ops']}")
        if roles and len(replayed) != self.pp - 1:
            problems.append(f"{len(replayed)} roles replayed, expected {self.pp - 1}")
        if roles.get("_forced_ops") or roles.get("_forced"):
            problems.append(f"{roles.get('_forced_ops') or roles.get('_forced')} ops forced")
        warn = [ln for ln in p.stderr.splitlines() if "role replay" in ln]
        problems += warn[:3]
        return {
            "launch_to_script_s": s["t_start"] - launch,
            "startup_s": s["t_mesh"] - launch,
            "startup_cpu_s": s["cpu_mesh"],
            "first_iteration_end_s": s["t_first"] - launch,
            "run_wall_s": end - launch,
            "run_cpu_s": (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime),
            "cpu_per_op_s": s["cpu_s"] / s["steady_ops"],
            "cpu_per_op_no_gc_s": (s["cpu_s"] - s["gc_s"]) / s["steady_ops"],
            "gc_per_op_s": s["gc_s"] / s["steady_ops"],
            "full_gcs": s["gc_full"],
            "full_gcs_before_mesh": s["full_gc_before_mesh"],
            "steady_ops": s["steady_ops"],
            "steady_wall_per_iteration_s": s["wall_s"] / s["steady_iters"],
            "problems": problems,
        }


def _med(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def _ratio_cell(big: float, small: float) -> str:
    r = big / small
    return f"{r:.2f} ({'within' if abs(r - 1) <= 0.10 else 'NOT within'} 10%)"


def _short(path: str) -> str:
    for pre in (str(ROOT) + "/.venv/lib/python3.11/site-packages/", str(ROOT) + "/"):
        path = path.replace(pre, "")
    return path


def _cum(prof: Path) -> dict:
    """Cumulative seconds, own seconds and calls per function (file:line(name))."""
    st = pstats.Stats(str(prof)).stats
    return {f"{_short(k[0])}:{k[1]}({k[2]})": (v[3], v[2], v[1]) for k, v in st.items()}


BLOCKING = ("time.sleep", "posix.waitpid", "select", "acquire", "poll", "_thread.lock", "wait_for")


def _grow(small: Path, big: Path, n: int) -> list[str]:
    """The functions whose own time grows most from ``small`` to ``big`` (blocking calls left out: not CPU)."""
    a, b = _cum(small), _cum(big)
    # Matched by file and name: a line may move between the runs while someone edits the file.
    # Comprehensions and generator expressions share a name: those keep their line.
    def strip(k: str) -> str:
        return k if "(<" in k or "(" not in k else k.split(":", 1)[0] + k[k.index("("):]
    a_by = {strip(k): v for k, v in a.items()}
    rows = []
    for k, v in b.items():
        if any(x in k for x in BLOCKING) or "<frozen" in k:
            continue
        w = a_by.get(strip(k), (0.0, 0.0, 0))
        rows.append((v[1] - w[1], k, w, v))
    rows.sort(reverse=True)
    out = [f"{'own small':>9} {'own big':>8} {'cum small':>9} {'cum big':>8} {'calls small':>11} {'calls big':>9}  function"]
    for _, k, w, v in rows[:n]:
        out.append(f"{w[1]:9.3f} {v[1]:8.3f} {w[0]:9.3f} {v[0]:8.3f} {w[2]:11d} {v[2]:9d}  {k}")
    return out


def cprofile(worlds: list[World], folder: Path, n: int) -> dict:
    """Steady-state and start-up cProfiles of the real rank in each world; what grows from a smaller world to the largest."""
    folder.mkdir(parents=True, exist_ok=True)
    for w in worlds:
        env = _env()
        env["ROLES_SCALE_CPROFILE"] = str(folder / f"steady-{w.ranks}.prof")
        _nbox("run", str(w.topo), "--rank", "0", "--role-profile", str(w.profile), "-q", "--", *w.command, env=env)
        child = folder / f"child-{w.ranks}.prof"
        cmd = [PY, "-m", "cProfile", "-o", str(child), str(w.script), *w.args]
        prof_dir = w.tmp / f"profile-cprofile-{w.ranks}"
        w.record(cmd, prof_dir)  # the digest covers the command: a profile of the cProfile'd command
        subprocess.run([PY, "-m", "cProfile", "-o", str(folder / f"parent-{w.ranks}.prof"), "-m", "neuronabox.cli",
                        "run", str(w.topo), "--rank", "0", "--role-profile", str(prof_dir), "-q", "--", *cmd],
                       capture_output=True, text=True, cwd=ROOT, env=_env(), check=True)
    big = worlds[-1]
    out = {}
    for small in worlds[:-1]:
        for what in ("steady", "child", "parent"):
            lines = _grow(folder / f"{what}-{small.ranks}.prof", folder / f"{what}-{big.ranks}.prof", n)
            out[(small.ranks, what)] = lines
            print(f"\ncProfile, {TITLES[what]}: own time growing most from {small.ranks} to {big.ranks} ranks "
                  f"({folder}/{what}-*.prof)")
            print("\n".join(lines))
    return out


TITLES = {"steady": "real rank, steady iterations (script's own cProfile)",
          "child": "real rank process, whole run (python -m cProfile)", "parent": "`nbox run` parent process"}


def main() -> None:
    """Record the profiles, run the worlds interleaved, print and write the tables."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worlds", default="2:2,8:4,1024:4",
                    help="RANKS:PP,... (first: the baseline the requirement compares against; last: the big world)")
    ap.add_argument("--ranks-per-node", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=20, help="iterations left out of the per-op CPU")
    ap.add_argument("--no-clones", dest="clones", action="store_false",
                    help="skip the runs without --role-profile (every other rank a clone: start-up without roles)")
    ap.add_argument("--cprofile", type=Path, default=None, help="also cProfile the real rank; .prof files here")
    ap.add_argument("--cprofile-rows", type=int, default=15)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "roles_scale.md")
    args = ap.parse_args()
    command = "python " + " ".join(shlex.quote(a) for a in [str(Path(sys.argv[0])), *sys.argv[1:]])
    t_begin = time.perf_counter()
    load_before = os.getloadavg()

    with tempfile.TemporaryDirectory(prefix="roles-scale-") as tmp_name:
        tmp = Path(tmp_name)
        (tmp / "train.py").write_text(SCRIPT)
        worlds = []
        for spec in args.worlds.split(","):
            ranks, _, pp = spec.partition(":")
            worlds.append(World(int(ranks), int(pp or 2), args.ranks_per_node, tmp, args))

        files, profile_s = {}, {}
        for w in worlds:
            print(f"nbox profile {w.name} ...", flush=True)
            profile_s[w.ranks] = w.record()
            files[w.ranks] = w.files()

        runs: dict[int, list[dict]] = {w.ranks: [] for w in worlds}
        clones: dict[int, list[dict]] = {w.ranks: [] for w in worlds}
        for rep in range(args.repeats):
            order = worlds[rep % len(worlds):] + worlds[:rep % len(worlds)]
            for w in order:
                for roles in (True, False) if args.clones else (True,):
                    r = w.run(tmp / f"report-{w.ranks}.json", roles)
                    (runs if roles else clones)[w.ranks].append(r)
                    print(f"  repeat {rep + 1}/{args.repeats} {w.name}{'' if roles else ', no roles'}: start-up "
                          f"{r['startup_s']:.2f} s ({r['startup_cpu_s']:.2f} s CPU), CPU/op {r['cpu_per_op_s'] * 1e6:.1f} us"
                          f" ({r['cpu_per_op_no_gc_s'] * 1e6:.1f} without GC, {r['full_gcs']} full GCs)"
                          + (f"  PROBLEMS: {r['problems']}" if r["problems"] else ""), flush=True)
        prof_out = cprofile(worlds, args.cprofile, args.cprofile_rows) if args.cprofile else None

    load_after = os.getloadavg()
    import torch

    metrics = ("launch_to_script_s", "startup_s", "startup_cpu_s", "first_iteration_end_s", "run_wall_s", "run_cpu_s",
               "cpu_per_op_s", "cpu_per_op_no_gc_s", "gc_per_op_s", "full_gcs", "steady_wall_per_iteration_s")
    med = {k: {m: _med(v, m) for m in metrics} for k, v in runs.items()}
    med_clones = {k: {m: _med(v, m) for m in metrics} for k, v in clones.items() if v}
    base, ctrl, big = worlds[0], (worlds[-2] if len(worlds) > 2 else None), worlds[-1]

    lines = [
        "# Roles at scale: `nbox run --role-profile` cost vs world size",
        "",
        f"Command: `{command}` ({(time.perf_counter() - t_begin) / 60:.1f} min)",
        "",
        (f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; machine: {platform.processor() or platform.machine()}, "
         f"{os.cpu_count()} cores, torch {torch.__version__}, python {platform.python_version()}; load average before "
         f"{[round(x, 2) for x in load_before]}, after {[round(x, 2) for x in load_after]}."),
        "",
        ("Requirement: a 1,024-rank world with 4 roles, `nbox run` start-up and per-collective CPU within 10% of a "
        "2-rank world's; profile files independent of world size. Workload: pipeline stages over "
        "`init_device_mesh(\"cpu\", (pp, dp), (\"pp\", \"dp\"))` (pp outermost), blocking send/recv of activations and "
        f"gradients on the pp group (4 micro-batches), a gradient all-reduce over the dp group, an SGD step; "
        f"{args.iters} iterations, one 16x16 linear layer per stage; one rank per node on a 10 Gbit/s switch, "
        "alpha-beta model. Roles: `--roles pp`. The real rank is rank 0 (stage 0): 10 ops an iteration in every world "
        "(4 sends, 4 receives, 2 all-reduces). "
        f"{args.repeats} runs per world, interleaved; medians. Start-up: launch of `nbox run` until the script's "
        "first iteration begins (just after `init_device_mesh`); its CPU: the real rank's process CPU until then "
        "(interpreter, imports, the emulator, the mesh; less noisy than the wall time on this machine). "
        "CPU/op: the real rank's process CPU over "
        f"iterations {args.warmup + 1}-{args.iters} divided by the ops it issued there (its tiny compute included); "
        "without GC: less the time in Python's garbage collector there (`gc.callbacks`): a full collection takes "
        "~0.15-0.3 s with torch loaded, and whether one falls in the window moves CPU/op by ~100 us, so CPU/op "
        "without GC is the emulator's own cost; full GCs: how many fell in the window (median)."
        + (" Without roles: the same `nbox run` without `--role-profile` (every other rank a clone of the real one)."
           if med_clones else "")),
        "",
        ("| world | roles | start-up (s) | start-up CPU (s) | first iteration done (s) | launch to script (s) | "
         "CPU/op (us) | CPU/op without GC (us) | GC/op (us) | full GCs | wall/iteration (ms) | run wall (s) | "
         "run CPU, all processes (s) | `nbox profile` (s) |"),
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for w in worlds:
        for label, mm in (("", med), (", without roles", med_clones)):
            if w.ranks not in mm:
                continue
            m = mm[w.ranks]
            lines.append(
                f"| {w.name}{label} | {w.pp if not label else '-'} | {m['startup_s']:.3f} | {m['startup_cpu_s']:.3f} | "
                f"{m['first_iteration_end_s']:.3f} | {m['launch_to_script_s']:.3f} | {m['cpu_per_op_s'] * 1e6:.1f} | "
                f"{m['cpu_per_op_no_gc_s'] * 1e6:.1f} | {m['gc_per_op_s'] * 1e6:.1f} | {m['full_gcs']:g} | "
                f"{m['steady_wall_per_iteration_s'] * 1e3:.2f} | {m['run_wall_s']:.2f} | {m['run_cpu_s']:.2f} | "
                f"{profile_s[w.ranks] if not label else 0:.1f} |".replace("| 0.0 |", "| - |"))
    lines += ["", "| ratio | start-up | start-up CPU | CPU/op | CPU/op without GC |", "|---|---|---|---|---|"]
    pairs = [(big, base, "requirement" if (big.ranks, base.ranks) == (1024, 2) else "largest over first", med)] + ([(big, ctrl, "same roles, world size alone", med)] if ctrl else [])
    if med_clones:
        pairs.append((big, base, "without roles", med_clones))
    for b, s, why, mm in pairs:
        lines.append(f"| {b.ranks} / {s.ranks} ranks ({why}) | {_ratio_cell(mm[b.ranks]['startup_s'], mm[s.ranks]['startup_s'])} "
                     f"| {_ratio_cell(mm[b.ranks]['startup_cpu_s'], mm[s.ranks]['startup_cpu_s'])} "
                     f"| {_ratio_cell(mm[b.ranks]['cpu_per_op_s'], mm[s.ranks]['cpu_per_op_s'])} "
                     f"| {_ratio_cell(mm[b.ranks]['cpu_per_op_no_gc_s'], mm[s.ranks]['cpu_per_op_no_gc_s'])} |")
    spread = {w.ranks: {m: (max(r[m] for r in runs[w.ranks]) - min(r[m] for r in runs[w.ranks])) / med[w.ranks][m]
                        for m in ("startup_s", "startup_cpu_s", "cpu_per_op_s", "cpu_per_op_no_gc_s")} for w in worlds}
    lines += ["", "Spread of the runs with roles ((max - min) / median): " + "; ".join(
        f"{w.ranks} ranks start-up {spread[w.ranks]['startup_s']:.0%} (CPU {spread[w.ranks]['startup_cpu_s']:.0%}), "
        f"CPU/op {spread[w.ranks]['cpu_per_op_s']:.0%} (without GC {spread[w.ranks]['cpu_per_op_no_gc_s']:.0%})"
        for w in worlds) + "."]
    # What the roles themselves cost: start-up over the same run without them; the actors' calls per real call.
    per_call = {w.ranks: sum(r["calls"] for n, r in files[w.ranks]["roles"].items() if n != "pp0")
                / files[w.ranks]["roles"]["pp0"]["calls"] for w in worlds}
    lines += ["", "Replayed calls per call of the real rank (the other roles' programs, walked by the replay): " + "; ".join(
        f"{w.ranks} ranks {per_call[w.ranks]:.1f}" for w in worlds) + "."
        + (" Start-up the roles add (with minus without `--role-profile`): " + "; ".join(
            f"{w.ranks} ranks {med[w.ranks]['startup_s'] - med_clones[w.ranks]['startup_s']:+.2f} s "
            f"({med[w.ranks]['startup_cpu_s'] - med_clones[w.ranks]['startup_cpu_s']:+.2f} s CPU of the real rank)"
            for w in worlds) + "." if med_clones else "")]
    problems = {w.ranks: sorted({p for r in runs[w.ranks] for p in r["problems"]}) for w in worlds}
    if any(problems.values()):
        lines.append(f"Replay problems: {problems}.")
    else:
        lines.append("Every run: the report's ops are the script's, every other role replayed, no op forced, no replay warning.")

    lines += ["", "Profile files (`nbox profile`):", "",
              "| world | folder bytes | profile.json bytes | role | calls | events | bytes | bytes/call | same calls as |",
              "|---|---:|---:|---|---:|---:|---:|---:|---|"]
    for w in worlds:
        f = files[w.ranks]
        for i, (name, r) in enumerate(f["roles"].items()):
            same = [f"{o.ranks}" for o in worlds if o is not w and (files[o.ranks]["roles"].get(name) or {}).get(
                "signature") == r["signature"]]
            head = (f"| {w.name} | {f['total_bytes']} | {f['manifest_bytes']} " if i == 0 else "| | | ")
            lines.append(head + f"| {name} | {r['calls']} | {r['events']} | {r['bytes']} | {r['bytes_per_call']:.0f} | "
                                f"{', '.join(same) or '-'} |")
    # Per call count: the big world's role files against the same roles elsewhere.
    cmp = []
    for o in worlds[:-1]:
        for name, r in files[big.ranks]["roles"].items():
            q = files[o.ranks]["roles"].get(name)
            if q and q["calls"] == r["calls"]:
                cmp.append(f"{name} {r['bytes_per_call'] / q['bytes_per_call']:.3f} vs {o.ranks} ranks")
    lines += ["", (f"Bytes per call, {big.ranks}-rank role file over the same role's in a smaller world "
                   f"(same call count): {'; '.join(cmp) or 'no role in common'}. "
                   f"profile.json (the manifest) lists every rank of every role: {files[base.ranks]['manifest_bytes']} B "
                   f"at {base.ranks} ranks, {files[big.ranks]['manifest_bytes']} B at {big.ranks}.")]
    if prof_out:
        lines += ["", ("cProfile (`--cprofile`, one run each): the functions whose own time grows most from a smaller "
                       f"world to {big.ranks} ranks (seconds under cProfile; blocking calls left out). One run each: "
                       "a full garbage collection (~0.15 s with torch loaded) lands on whatever runs then, e.g. a "
                       "torch or sympy import function; rows with equal call counts in both worlds are such noise.")]
        for (small, what), rows in prof_out.items():
            lines += ["", f"{TITLES[what]}, {small} -> {big.ranks} ranks:", "", "```", *rows, "```"]
    text = "\n".join(lines) + "\n"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    doc = {"command": command, "worlds": {w.ranks: {"pp": w.pp, "dp": w.dp, "median": med[w.ranks],
                                                    "runs": runs[w.ranks], "median_without_roles": med_clones.get(w.ranks),
                                                    "runs_without_roles": clones[w.ranks], "profile_s": profile_s[w.ranks],
                                                    "files": {**files[w.ranks], "roles": {
                                                        n: {k: v for k, v in r.items() if k != "signature"}
                                                        for n, r in files[w.ranks]["roles"].items()}}}
                                          for w in worlds}}
    args.out.with_suffix(".json").write_text(json.dumps(doc, indent=2) + "\n")
    print()
    print(text)
    print(f"wrote {args.out} and {args.out.with_suffix('.json')}")


if __name__ == "__main__":
    main()
