"""Hybrid collectives: two real CPU processes (gloo between them) plus emulated ranks, driven with the env contract.

Each test starts the real ranks itself: a TCPStore server hosted here, ``runner.child_env`` (the
environment ``nbox run`` gives a real rank, sitecustomize included) plus ``NBOX_REAL_RANKS``,
``NBOX_REAL_STORE``, ``NBOX_REAL_STORE_PREFIX`` and ``NBOX_REAL_TIMEOUT``.
"""

from __future__ import annotations

import json
import signal
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="hybrid collectives need torch")
dist = torch.distributed

from neuronabox.emu.hybrid import mirror_map, parse_real_ranks  # noqa: E402
from neuronabox.launcher.runner import child_env  # noqa: E402
from neuronabox.errors import InputError  # noqa: E402
from neuronabox.topology import parse_topology  # noqa: E402

pytestmark = pytest.mark.torch

ROOT = Path(__file__).resolve().parent.parent


def _topology_text(nodes: int, per_node: int, bandwidth: str = "100Gbps", latency: str = "5us") -> str:
    return (f"cluster: {{nodes: {nodes}, ranks_per_node: {per_node}}}\n"
            f"network: {{type: switch, link: {{bandwidth: {bandwidth}, latency: {latency}}}}}\n")


class RealRanks:
    """Real rank processes of one hybrid run, started with the env contract; killed if the test leaves them."""

    def __init__(self, tmp: Path, topology_text: str, real: list[int], timeout: float = 60.0, model: str | None = None):
        self.tmp = tmp
        self.real = real
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        self.topo_file = tmp / "topology.yaml"
        self.topo_file.write_text(topology_text)
        self.topology = parse_topology(topology_text, str(self.topo_file))
        self.timeout = timeout
        self.model = model
        self.prefix = f"hybrid-test-{uuid.uuid4().hex[:8]}/"
        self.procs: dict[int, subprocess.Popen] = {}

    def env(self, rank: int) -> dict[str, str]:
        env = child_env(self.topo_file, self.topology, rank, self.record(rank), self.model)
        env.update({
            "NBOX_REAL_RANKS": ",".join(map(str, self.real)),
            "NBOX_REAL_STORE": f"127.0.0.1:{self.store.port}",
            "NBOX_REAL_STORE_PREFIX": self.prefix,
            "NBOX_REAL_TIMEOUT": str(self.timeout),
            "OMP_NUM_THREADS": "1",
        })
        return env

    def record(self, rank: int) -> Path:
        return self.tmp / f"record-{rank}.json"

    def start(self, argv: list[str], ranks: list[int] | None = None) -> None:
        for r in ranks if ranks is not None else self.real:
            out = open(self.tmp / f"out-{r}.txt", "w")
            self.procs[r] = subprocess.Popen(argv, env=self.env(r), stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)

    def wait(self, limit: float) -> dict[int, int]:
        deadline = time.monotonic() + limit
        codes = {}
        for r, p in self.procs.items():
            try:
                codes[r] = p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                codes[r] = None
        return codes

    def output(self, rank: int) -> str:
        return (self.tmp / f"out-{rank}.txt").read_text()

    def close(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()


@pytest.fixture
def real_ranks(tmp_path):
    runs: list[RealRanks] = []

    def make(*args, **kwargs) -> RealRanks:
        runs.append(RealRanks(tmp_path, *args, **kwargs))
        return runs[-1]

    yield make
    for run in runs:
        run.close()


# --- the mirror map and the env contract (no processes) ---------------------------------------------


def test_mirror_map_deals_emulated_members_round_robin():
    assert mirror_map(8, [0, 1]) == [0, 1, 0, 1, 0, 1, 0, 1]
    assert mirror_map(8, [1, 6]) == [0, 0, 1, 0, 1, 0, 1, 1]  # emulated 0,2,3,4,5,7 -> 0,1,0,1,0,1
    m = mirror_map(5, [1, 3])  # n not a multiple of k: counts 3 and 2
    assert [m.count(i) for i in range(2)] == [3, 2]
    assert mirror_map(8, [0, 4]).count(0) == 4  # balanced wherever the real ranks sit


def test_real_ranks_env_is_checked():
    assert parse_real_ranks(None, 8, 3) == (3,)
    assert parse_real_ranks("1,0", 8, 0) == (0, 1)
    for bad in ("0,x", "0,9", "1,2"):
        with pytest.raises(InputError, match="NBOX_REAL_RANKS"):
            parse_real_ranks(bad, 8, 0)


def test_several_real_ranks_need_the_store(monkeypatch):
    from neuronabox.emu.emulator import Emulator

    monkeypatch.setenv("NBOX_REAL_RANKS", "0,1")
    monkeypatch.delenv("NBOX_REAL_STORE", raising=False)
    with pytest.raises(InputError, match="NBOX_REAL_STORE"):
        Emulator(parse_topology(_topology_text(1, 8)), 0, "ideal")
    monkeypatch.setenv("NBOX_REAL_STORE", "127.0.0.1:1")
    monkeypatch.setenv("NBOX_REAL_TIMEOUT", "soon")
    with pytest.raises(InputError, match="NBOX_REAL_TIMEOUT"):
        Emulator(parse_topology(_topology_text(1, 8)), 0, "ideal")


# --- (a) every collective in a 2-real + 6-emulated world ------------------------------------------------

COLLECTIVES = r'''
import json, os, sys, warnings
import torch, torch.distributed as dist
from torch.distributed.distributed_c10d import _coalescing_manager
warnings.simplefilter("ignore")
torch.set_num_threads(1)
dist.init_process_group("gloo")
me, n = dist.get_rank(), dist.get_world_size()
REAL = [int(r) for r in os.environ["NBOX_REAL_RANKS"].split(",")]

def mirrors(group_ranks):
    """Independent restatement of the rule: the e-th emulated member mirrors real member e mod k."""
    reals = [g for g in group_ranks if g in REAL]
    out, e = {}, 0
    for g in group_ranks:
        if g in REAL:
            out[g] = g
        else:
            out[g] = reals[e % len(reals)]
            e += 1
    return out

def x(r):
    return torch.arange(4.0) + 10 * r

def eq(a, b, what):
    if not torch.allclose(a, b):
        raise AssertionError(f"rank {me}: {what}: got {a.tolist()} want {b.tolist()}")

world = list(range(n))
M = mirrors(world)
real_sum = sum(x(M[g]) for g in world)  # sum over the group of each member's mirror's tensor

# all-reduce
t = x(me); dist.all_reduce(t); eq(t, real_sum, "all_reduce SUM")
eq(real_sum, (x(REAL[0]) + x(REAL[1])) * n / len(REAL), "balanced: SUM = real sum x n/k")
t = x(me); dist.all_reduce(t, op=dist.ReduceOp.AVG); eq(t, real_sum / n, "all_reduce AVG")
t = x(me); dist.all_reduce(t, op=dist.ReduceOp.MAX); eq(t, x(max(REAL)), "all_reduce MAX")
t = x(me) + 1; dist.all_reduce(t, op=dist.ReduceOp.PRODUCT)
eq(t, torch.prod(torch.stack([x(M[g]) + 1 for g in world]), 0), "all_reduce PRODUCT")
ints = torch.tensor([me, 1]); dist.all_reduce(ints)
eq(ints.double(), torch.tensor([sum(M[g] for g in world), n]).double(), "int SUM")

# a subgroup whose size (5) is not a multiple of k: the exact mirrored sum
sub = [0, REAL[0], 2, REAL[1], 7] if REAL == [1, 6] else None
if sub:
    pg = dist.new_group(sub)
    Ms = mirrors(sub)
    t = x(me); dist.all_reduce(t, group=pg); eq(t, sum(x(Ms[g]) for g in sub), "subgroup SUM (5 ranks, k=2)")
    counts = {r: sum(1 for g in sub if Ms[g] == r) for r in REAL}
    assert sorted(counts.values()) == [2, 3], counts

# a group with one real member keeps the single-real rule: every emulated member mirrors it
solo = dist.new_group([0, REAL[0], 2]) if 0 not in REAL and 2 not in REAL else None
if solo is not None and me == REAL[0]:
    t = x(me); dist.all_reduce(t, group=solo); eq(t, x(me) * 3, "group with one real member")

# broadcast from a real and from an emulated root
for root in (REAL[1], 0):
    t = x(me); dist.broadcast(t, src=root); eq(t, x(M[root]), f"broadcast from {root}")
# reduce to a real root, and to an emulated one (buffers stay)
t = x(me); dist.reduce(t, dst=REAL[1])
eq(t, real_sum if me == REAL[1] else x(me), "reduce to a real root")
t = x(me); dist.reduce(t, dst=3); eq(t, x(me), "reduce to an emulated root")

# all-gather: real chunks are real, emulated chunks are their mirror's
outs = [torch.zeros(4) for _ in world]; dist.all_gather(outs, x(me))
for g in world: eq(outs[g], x(M[g]), f"all_gather chunk {g}")
out = torch.zeros(n * 4); dist.all_gather_into_tensor(out, x(me))
eq(out, torch.cat([x(M[g]) for g in world]), "all_gather_into_tensor")
got = [None] * n; dist.all_gather_object(got, {"r": me})
assert got == [{"r": M[g]} for g in world], got

# reduce-scatter: my chunk summed over the members' mirrors
def rs_in(r):
    return torch.cat([x(r) + 100 * j for j in world])
want = sum(x(M[g]) + 100 * me for g in world)
y = torch.zeros(4); dist.reduce_scatter_tensor(y, rs_in(me)); eq(y, want, "reduce_scatter_tensor")
y = torch.zeros(4); dist.reduce_scatter(y, list(rs_in(me).split(4))); eq(y, want, "reduce_scatter")
y = torch.zeros(4); dist.reduce_scatter_tensor(y, rs_in(me), op=dist.ReduceOp.AVG)
eq(y, want / n, "reduce_scatter AVG")

# all-to-all: chunk j is what j's mirror sends to me
a2a = lambda r: torch.tensor([1000.0 * r + j for j in world])
o = torch.zeros(n); dist.all_to_all_single(o, a2a(me))
eq(o, torch.tensor([1000.0 * M[g] + me for g in world]), "all_to_all_single")
ol = [torch.zeros(1) for _ in world]; dist.all_to_all(ol, list(a2a(me).split(1)))
eq(torch.cat(ol), torch.tensor([1000.0 * M[g] + me for g in world]), "all_to_all")

# gather and scatter
gl = [torch.zeros(4) for _ in world] if me == REAL[0] else None
dist.gather(x(me), gl, dst=REAL[0])
if me == REAL[0]:
    for g in world: eq(gl[g], x(M[g]), f"gather slot {g}")
dist.gather(x(me), None, dst=5)  # to an emulated root: nothing to check but that it returns
y = torch.full((4,), -1.0)
dist.scatter(y, [x(100 + j) for j in world] if me == REAL[1] else None, src=REAL[1]); eq(y, x(100 + me), "scatter")
y = torch.full((4,), -1.0); dist.scatter(y, None, src=4); eq(y, torch.full((4,), -1.0), "scatter from emulated root")

# barrier, object broadcast (every real rank its own root), send/recv real<->real and real<->emulated
dist.barrier()
objs = [{"from": me}]; dist.broadcast_object_list(objs, src=0); assert objs == [{"from": me}], objs
peer = REAL[1] if me == REAL[0] else REAL[0]
t = x(me) if me == REAL[0] else torch.zeros(4)
if me == REAL[0]: dist.send(t, peer)
else: dist.recv(t, peer); eq(t, x(REAL[0]), "recv from a real rank")
mine, theirs = x(me), torch.zeros(4)
for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, mine, peer), dist.P2POp(dist.irecv, theirs, peer)]):
    w.wait()
eq(theirs, x(peer), "isend/irecv both ways")
emu = 3 if 3 not in REAL else 4
dist.send(x(me), emu); r = torch.zeros(4); dist.recv(r, emu); eq(r, x(me), "recv from an emulated rank")

# coalesced
a, b = x(me), x(me) * 2
with _coalescing_manager(device=torch.device("cpu")):
    dist.all_reduce(a); dist.all_reduce(b)
eq(a, real_sum, "coalesced a"); eq(b, real_sum * 2, "coalesced b")
o1, o2 = torch.zeros(n), torch.zeros(2 * n)
with _coalescing_manager(device=torch.device("cpu")):
    dist.all_gather_into_tensor(o1, torch.ones(1) * me); dist.all_gather_into_tensor(o2, torch.ones(2) * me)
eq(o1, torch.tensor([float(M[g]) for g in world]), "coalesced all_gather")
opts = dist.AllreduceCoalescedOptions(); opts.reduceOp = dist.ReduceOp.SUM
c, d = x(me), x(me)
dist.group.WORLD.allreduce_coalesced([c, d], opts).wait(); eq(c, real_sum, "allreduce_coalesced")

# async works and futures: both real ranks complete at the same modeled instant
t = x(me)
fut = dist.all_reduce(t, async_op=True).get_future()
fut.wait(); eq(t, real_sum, "future result")
from neuronabox.emu import emulator
ops = emulator.current().recorder.ops
last = [r for r in ops if r.op.value == "all_reduce"][-1]
print("LAST_END", json.dumps({"end": last.end, "start": last.start, "duration": last.duration}))
dist.destroy_process_group()
print("ALL_OK", me)
'''


def test_every_collective_with_two_real_ranks(real_ranks, tmp_path):
    run = real_ranks(_topology_text(1, 8), real=[1, 6])
    script = tmp_path / "collectives.py"
    script.write_text(COLLECTIVES)
    run.start([sys.executable, str(script)])
    codes = run.wait(240)
    outs = {r: run.output(r) for r in run.real}
    assert codes == {1: 0, 6: 0}, outs
    for r in run.real:
        assert f"ALL_OK {r}" in outs[r], outs[r]
    ends = [json.loads(next(ln.split(" ", 1)[1] for ln in outs[r].splitlines() if ln.startswith("LAST_END")))
            for r in run.real]
    assert ends[0]["end"] == pytest.approx(ends[1]["end"], abs=1e-6), ends  # same modeled instant
    assert ends[0]["start"] == pytest.approx(ends[1]["start"], abs=1e-6), ends


# --- (b) unmodified DDP, 2 real + 62 emulated ----------------------------------------------------------


def test_ddp_two_real_ranks_train_in_step(real_ranks):
    # 100 Mbps: the modeled all-reduces of 64 ranks (about 170 ms for a 1 MB bucket) outlast the real
    # 2-rank gloo transfer even on a loaded 2-core box (where it can take 20 ms), so the model sets the pace.
    run = real_ranks(_topology_text(8, 8, bandwidth="100Mbps", latency="10us"), real=[0, 1])
    run.start([sys.executable, str(ROOT / "examples" / "ddp_train.py"), "--steps", "15", "--width", "256"])
    codes = run.wait(300)
    assert codes == {0: 0, 1: 0}, {r: run.output(r) for r in run.real}
    assert "rank 0 of 64: 15 steps" in run.output(0)
    iters = {r: json.loads(run.record(r).read_text())["iterations"] for r in run.real}
    assert len(iters[0]) == len(iters[1]) == 15
    med = {r: statistics.median(v[1:]) for r, v in iters.items()}
    assert abs(med[0] - med[1]) / max(med.values()) < 0.02, med
    total = {r: sum(v[1:]) for r, v in iters.items()}
    assert abs(total[0] - total[1]) / max(total.values()) < 0.02, total


# --- (c) failures: a real rank dies, or never comes -----------------------------------------------------

LOOP = r'''
import sys, time, torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(1000)
for i in range(100000):
    dist.all_reduce(t)
    t.fill_(1.0)
    if i == 20:
        print("RUNNING", flush=True)
'''


@pytest.mark.parametrize("workload", ["all_reduce loop", "DDP"])
def test_survivor_fails_clearly_when_a_real_rank_is_killed(real_ranks, tmp_path, workload):
    run = real_ranks(_topology_text(1, 8), real=[0, 1], timeout=20)
    if workload == "DDP":  # the failure reaches the script through DDP's futures, not Work.wait()
        argv, marker = [sys.executable, str(ROOT / "examples" / "ddp_train.py"), "--steps", "100000"], "step   5"
    else:
        (tmp_path / "loop.py").write_text(LOOP)
        argv, marker = [sys.executable, str(tmp_path / "loop.py")], "RUNNING"
    run.start(argv)
    deadline = time.monotonic() + 120
    while marker not in run.output(0) and time.monotonic() < deadline:
        assert run.procs[0].poll() is None and run.procs[1].poll() is None, run.output(0) + run.output(1)
        time.sleep(0.1)
    assert marker in run.output(0), run.output(0)
    run.procs[1].send_signal(signal.SIGKILL)
    killed = time.monotonic()
    code = run.procs[0].wait(timeout=60)
    took = time.monotonic() - killed
    out = run.output(0)
    assert code != 0, out
    assert took < 20 + 10, took
    assert "nbox:" in out and "real rank 1" in out, out


def test_a_real_rank_that_never_comes_is_named(real_ranks, tmp_path):
    run = real_ranks(_topology_text(1, 8), real=[0, 1], timeout=4)
    script = tmp_path / "loop.py"
    script.write_text(LOOP)
    start = time.monotonic()
    run.start([sys.executable, str(script)], ranks=[0])
    code = run.procs[0].wait(timeout=90)
    out = run.output(0)
    assert code != 0, out
    assert "real rank 1 did not join" in out, out
    assert time.monotonic() - start < 4 + 60  # the timeout plus interpreter and torch start-up on a loaded box


@pytest.mark.parametrize("script,real", [("fsdp2_train.py", [0, 1]), ("mesh_2d_train.py", [0, 8])])
def test_example_scripts_train_with_two_real_ranks(real_ranks, script, real):
    # FSDP2: both real ranks in every group. 2-D mesh with real ranks 0 and 8: the DP groups hold
    # both (hybrid), each TP group holds one (the single-real path) — the two paths side by side.
    run = real_ranks(_topology_text(2, 8), real=real)
    run.start([sys.executable, str(ROOT / "examples" / script)])
    codes = run.wait(300)
    assert codes == {r: 0 for r in real}, {r: run.output(r) for r in real}
    assert all("done:" in run.output(r) for r in real)
