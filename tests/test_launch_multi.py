"""``nbox run`` with several real ranks: torch's elastic launcher, the environment contract, one report per rank.

What runs for real: torch's ``LocalElasticAgent`` and its c10d rendezvous, the workers, a gloo
group among the real ranks over the agent's store, and (root) two cluster nodes in two network
namespaces with a shaped link between them, each running its own ``nbox run``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

pytest.importorskip("torch", reason="nbox run needs torch")

from neuronabox.launcher.elastic import LaunchOptions, choose_real_ranks, plan_launch, worker_env  # noqa: E402
from neuronabox.errors import InputError  # noqa: E402
from neuronabox.report.run_summary import summarize_ranks, summary_tables  # noqa: E402

from .conftest import ROOT, private_cluster_state, run_nbox, topo  # noqa: E402

PY = sys.executable
CPU64 = ROOT / "topologies" / "cpu-64-demo.yaml"
DDP = ROOT / "examples" / "ddp_train.py"

# Uses the contract directly: a gloo group of the real ranks on NBOX_REAL_STORE (no nbox backend).
ENVCHECK = textwrap.dedent(
    """
    import datetime, json, os
    import torch, torch.distributed as dist
    keys = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "NBOX_REAL_RANK",
            "NBOX_REAL_RANKS", "NBOX_REAL_STORE", "NBOX_REAL_STORE_PREFIX", "NBOX_LAUNCH_RANK", "TORCHELASTIC_RUN_ID"]
    env = {k: os.environ.get(k) for k in keys}
    reals = [int(r) for r in os.environ["NBOX_REAL_RANKS"].split(",")]
    me = reals.index(int(os.environ["NBOX_REAL_RANK"]))
    host, port = os.environ["NBOX_REAL_STORE"].rsplit(":", 1)
    timeout = datetime.timedelta(seconds=60)
    store = dist.PrefixStore(os.environ["NBOX_REAL_STORE_PREFIX"] + "/envcheck",
                             dist.TCPStore(host, int(port), is_master=False, timeout=timeout))
    pg = dist.ProcessGroupGloo(store, me, len(reals), timeout)
    t = torch.tensor([float(os.environ["NBOX_REAL_RANK"])])
    pg.allreduce([t]).wait()
    env["sum"] = t.item()
    env["affinity"] = sorted(os.sched_getaffinity(0))
    os.write(1, ("ENVCHECK " + json.dumps(env) + "\\n").encode())  # one write: the workers share stdout
    del pg
    """
)

# The data check of the hybrid collectives: each emulated rank mirrors a real one, so a SUM over
# the world is the real ranks' sum times world/real.
SUMCHECK = textwrap.dedent(
    """
    import os, torch, torch.distributed as dist
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    reals = [int(r) for r in os.environ["NBOX_REAL_RANKS"].split(",")]
    t = torch.full((1000,), float(dist.get_rank() + 1))
    dist.all_reduce(t)
    want = sum(r + 1 for r in reals) * world / len(reals)
    assert torch.allclose(t, torch.full_like(t, want)), (t[:4], want)
    os.write(1, f"SUMCHECK rank {dist.get_rank()} got {t[0].item()} want {want}\\n".encode())
    dist.destroy_process_group()
    """
)

# Real rank DIE_RANK (default 1) dies hard after a few steps; the others keep calling collectives.
DIES = textwrap.dedent(
    """
    import os, time, torch, torch.distributed as dist
    dist.init_process_group("gloo")
    x = torch.ones(1 << 16)
    for step in range(400):
        dist.all_reduce(x)
        if step == 3 and dist.get_rank() == int(os.environ.get("DIE_RANK", "1")):
            os._exit(9)
        time.sleep(0.01)
    print("SURVIVED", dist.get_rank(), flush=True)
    """
)


SIXTEEN = "cluster: {nodes: 4, ranks_per_node: 4}\nnetwork: {type: switch, link: {bandwidth: 10Gbps, latency: 1us}}\n"


def _envchecks(out: str) -> dict[int, dict]:
    rows = [json.loads(line.split(" ", 1)[1]) for line in out.splitlines() if line.startswith("ENVCHECK ")]
    return {int(r["NBOX_REAL_RANK"]): r for r in rows}


# ---- which ranks are real; the worker's environment ------------------------------------------------
def test_real_ranks_are_the_first_k_of_the_first_n_nodes_unless_the_topology_lists_n_times_k():
    t = topo(SIXTEEN)
    assert choose_real_ranks(t, 2, 1) == [0, 1]
    assert choose_real_ranks(t, 2, 3) == [0, 1, 4, 5, 8, 9]
    assert choose_real_ranks(t, 1, 1) == [0]
    listed = topo(SIXTEEN + "emulation: {real_ranks: [13, 6]}\n")
    assert choose_real_ranks(listed, 2, 1) == [6, 13]  # exactly N*K listed: those, sorted
    assert choose_real_ranks(listed, 1, 3) == [0, 4, 8]  # otherwise the default rule
    with pytest.raises(InputError, match="--nproc-per-node: 5 real ranks per node but node node0"):
        choose_real_ranks(t, 5, 1)
    with pytest.raises(InputError, match="--nnodes: 5 real nodes but topology"):
        choose_real_ranks(t, 1, 5)


def test_launch_plan_follows_torchrun_rendezvous_rules():
    t = topo(SIXTEEN)
    alone = plan_launch(t, LaunchOptions(nproc_per_node=2))
    assert (alone.rdzv_backend, alone.rdzv_endpoint, alone.rdzv_configs) == ("c10d", "127.0.0.1:0", {"is_host": True})
    assert alone.cpu_cores == sorted(os.sched_getaffinity(0)) and alone.real_ranks == [0, 1]
    static = plan_launch(t, LaunchOptions(nnodes="2", node_rank=1, rdzv_endpoint="10.1.2.3:29400"))
    assert (static.rdzv_backend, static.rdzv_configs, static.run_id) == ("static", {"rank": 1}, "none")
    here = plan_launch(t, LaunchOptions(nnodes="2", rdzv_endpoint="127.0.0.1:29400", rdzv_backend="c10d", rdzv_id="j"))
    assert here.rdzv_configs == {"is_host": True} and here.run_id == "j"  # one of this machine's addresses
    away = plan_launch(t, LaunchOptions(nnodes="2", rdzv_endpoint="192.0.2.7:29400", rdzv_backend="c10d"))
    assert away.rdzv_configs == {}  # not ours: torch's own guess decides
    gpu = topo("cluster: {nodes: 2, ranks_per_node: 8, device: H100}\n"
               "network: {type: switch, link: {bandwidth: 100Gbps, latency: 2us}}\nemulation: {real_ranks: [3, 4]}\n")
    ok = plan_launch(gpu, LaunchOptions(nproc_per_node=2, nnodes="2", node_rank=0, rdzv_endpoint="10.0.0.1:1"))
    assert ok.real_ranks == [0, 1, 8, 9] and ok.cpu_cores is None  # GPU workers: LOCAL_RANK is the device
    with pytest.raises(InputError, match="first 2 local ranks of their nodes .* rank 3 is local rank 3"):
        plan_launch(gpu, LaunchOptions(nproc_per_node=2))  # the listed [3, 4]: local ranks 3, 4 on this node


def test_worker_env_turns_torchrun_values_into_the_emulated_world():
    t = topo(SIXTEEN)
    torchrun = {
        "RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1",
        "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "4567", "TORCHELASTIC_RUN_ID": "job7",
        "TORCHELASTIC_RESTART_COUNT": "2", "TORCHELASTIC_MAX_RESTARTS": "3", "NBOX_REAL_RANKS": "0,1,4,5",
        "NBOX_RECORD_DIR": "/tmp/recs", "NBOX_METRICS_ADDR": "0.0.0.0:9400",
    }
    env = worker_env(torchrun, t)
    assert env["RANK"] == env["NBOX_REAL_RANK"] == env["ROLE_RANK"] == "5"
    assert (env["WORLD_SIZE"], env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"]) == ("16", "1", "4")
    assert (env["GROUP_RANK"], env["GROUP_WORLD_SIZE"]) == ("1", "4")
    assert env["NBOX_REAL_STORE"] == "10.0.0.1:4567"
    assert env["NBOX_REAL_STORE_PREFIX"] == "nbox/job7/2"  # a restart gets fresh keys
    elastic = ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS")
    assert [env[k] for k in elastic] == ["job7", "2", "3"]
    assert (env["NBOX_LAUNCH_RANK"], env["NBOX_LAUNCH_LOCAL_RANK"], env["NBOX_LAUNCH_WORLD_SIZE"]) == ("3", "1", "4")
    assert env["NBOX_RECORD"] == "/tmp/recs/rank-5.json"
    assert env["NBOX_METRICS_ADDR"] == "0.0.0.0:9401"  # one exporter per real rank of this machine
    assert "NBOX_REAL_RANKS" not in env  # the parent's value stays as it is
    with pytest.raises(RuntimeError, match="started 3 workers .* 4 real ranks"):
        worker_env({**torchrun, "WORLD_SIZE": "3", "RANK": "0"}, t)


def test_summary_of_several_ranks_puts_them_side_by_side_with_the_spread():
    def rec(rank, its):
        op = {"op": "all_reduce", "iteration": 1, "enqueue": 0.1, "start": 0.1, "end": 0.15, "duration": 0.05,
              "wait": 0.05, "nbytes": 4096, "algorithm": "ring", "comm": "world", "ranks": 64, "seq": 0}
        return {"world_size": 64, "real_rank": rank, "model": "alpha-beta", "iterations": its, "ops": [op]}

    rep = summarize_ranks({1: rec(1, [0.5, 0.2, 0.21, 0.2]), 0: rec(0, [0.5, 0.2, 0.2, 0.2])}, None, {"topology": "t"})
    assert rep["real_ranks"] == [0, 1] and set(rep["ranks"]) == {"0", "1"}
    assert rep["ranks"]["1"]["iteration_time"]["median"] == pytest.approx(0.2)
    assert rep["iteration_time_spread"]["relative"] == pytest.approx(0.0)
    rep = summarize_ranks({0: rec(0, [0.5, 0.2, 0.2, 0.2]), 1: rec(1, [0.5, 0.22, 0.22, 0.22])})
    assert rep["iteration_time_spread"]["relative"] == pytest.approx(0.1)
    titles = [t.title for t in summary_tables(rep)]
    assert titles[:2] == ["nbox run", "real ranks (measured iterations)"]
    assert rep["real_rank"] == 0 and rep["iterations"] == [0.5, 0.2, 0.2, 0.2]  # the top level: the first real rank


# ---- the launcher for real (no hybrid collectives needed) -------------------------------------------
def test_two_workers_get_the_contract_and_share_the_agent_store(tmp_path):
    script = tmp_path / "envcheck.py"
    script.write_text(ENVCHECK)
    r = run_nbox("run", str(CPU64), "--nproc-per-node", "2", "--", PY, str(script))
    assert r.returncode == 0, r.stderr[-3000:]
    rows = _envchecks(r.stdout)
    assert set(rows) == {0, 1}
    for world_rank, row in rows.items():
        assert row["RANK"] == str(world_rank) and row["WORLD_SIZE"] == "64"
        assert row["LOCAL_RANK"] == str(world_rank) and row["LOCAL_WORLD_SIZE"] == "4"
        assert row["GROUP_RANK"] == "0" and row["GROUP_WORLD_SIZE"] == "16"
        assert row["NBOX_REAL_RANKS"] == "0,1" and row["NBOX_LAUNCH_RANK"] == str(world_rank)
        assert row["sum"] == 1.0  # 0 + 1, over gloo among the real ranks, on the agent's store
    assert rows[0]["NBOX_REAL_STORE"] == rows[1]["NBOX_REAL_STORE"]
    assert rows[0]["NBOX_REAL_STORE_PREFIX"] == f"nbox/{rows[0]['TORCHELASTIC_RUN_ID']}/0"
    cores = sorted(os.sched_getaffinity(0))
    assert [rows[r]["affinity"] for r in (0, 1)] == [[cores[0]], [cores[1 % len(cores)]]]  # one core each


def test_a_failing_worker_fails_the_run_and_is_named(tmp_path):
    script = tmp_path / "fail.py"
    script.write_text("import os, sys, time\nif os.environ['NBOX_LAUNCH_RANK'] == '1':\n    sys.exit(3)\n"
                      "time.sleep(120)\n")
    t0 = time.monotonic()
    r = run_nbox("run", str(CPU64), "--nproc-per-node", "2", "--", PY, str(script))
    assert time.monotonic() - t0 < 60  # the agent stops the other worker: no wait for its sleep
    assert r.returncode == 1
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("nbox: error: real rank 1 (launch rank 1) exited with status 3"), last


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--nproc-per-node", "0"], "--nproc-per-node: must be 1 or more"),
        (["--nproc-per-node", "5"], "--nproc-per-node: 5 real ranks per node but node node0"),
        (["--nnodes", "17", "--rdzv-endpoint", "127.0.0.1:29400"], "--nnodes: 17 real nodes"),
        (["--nnodes", "1:2"], "--nnodes: expected a whole number"),
        (["--nproc-per-node", "2", "--rank", "3"], "--rank: picks the one real rank"),
        (["--nnodes", "2"], "--rdzv-endpoint: --nnodes 2 needs HOST:PORT"),
        (["--nnodes", "2", "--rdzv-endpoint", "nohost"], "--rdzv-endpoint: expected HOST:PORT"),
        (["--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:29400", "--rdzv-backend", "etcd"], "--rdzv-backend: expected"),
        (["--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:29400"], "--node-rank: the static rendezvous needs"),
        (["--nnodes", "2", "--node-rank", "2", "--rdzv-endpoint", "127.0.0.1:29400"], "--node-rank: must be in 0-1"),
        (["--nproc-per-node", "2", "--max-restarts", "-1"], "--max-restarts: must be 0 or more"),
        (["--nproc-per-node", "2", "--mode", "wire", "--cluster", "nosuch"], None),
    ],
)
def test_bad_flags_exit_2_with_one_line(flags, named):
    r = run_nbox("run", str(CPU64), *flags, "--", PY, "-c", "pass")
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("nbox: error: "), r.stderr
    if named:
        assert named in lines[0]


def test_command_not_found_exits_2():
    r = run_nbox("run", str(CPU64), "--nproc-per-node", "2", "--", "no-such-command-xyz")
    assert r.returncode == 2 and "command not found" in r.stderr


# ---- with the hybrid collectives (neuronabox/emu/hybrid.py) -------------------------------------------
def test_ddp_with_two_real_ranks_trains_to_the_end_and_both_ranks_agree(tmp_path):
    rep_file = tmp_path / "run.json"
    trace = tmp_path / "trace.json"
    r = run_nbox("run", str(CPU64), "--nproc-per-node", "2", "--report", str(rep_file), "--trace", str(trace),
                 "--", PY, str(DDP), "--steps", "40", "--width", "1024")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "rank 0 of 64: 40 steps" in r.stdout
    assert "real ranks (measured iterations)" in r.stdout and "spread" in r.stdout
    rep = json.loads(rep_file.read_text())
    assert rep["real_ranks"] == [0, 1] and rep["world_size"] == 64
    for k in ("0", "1"):
        assert len(rep["ranks"][k]["iterations"]) == 40
        assert rep["ranks"][k]["per_op"]["all_reduce"]["count"] > 0
    # Every real rank completes each collective at the same modeled instant: the same iteration
    # times. Single iterations still differ by the scheduling jitter of the compute after the
    # last collective (optimizer step), a few ms on a loaded 2-core box, alternating in sign
    # since the next collective re-aligns the ranks: the means agree to well under 1%, the
    # medians within 2% on a quiet machine (figures_launch.md) and within 5% under load.
    means = [rep["ranks"][k]["iteration_time"]["mean"] for k in ("0", "1")]
    assert max(means) / min(means) - 1 < 0.01, means
    assert rep["iteration_time_spread"]["relative"] < 0.05, rep["iteration_time_spread"]
    # The report and the trace read as the first real rank's by the one-rank tools.
    assert json.loads(trace.read_text())["traceEvents"]
    shown = run_nbox("report", str(rep_file), "--no-png")
    assert shown.returncode == 0 and "real ranks (measured iterations)" in shown.stdout, shown.stderr


def test_all_reduce_sum_is_the_real_sum_times_world_over_real(tmp_path):
    script = tmp_path / "sum.py"
    script.write_text(SUMCHECK)
    r = run_nbox("run", str(CPU64), "--nproc-per-node", "2", "-q", "--", PY, str(script))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "SUMCHECK rank 0 got 96.0 want 96.0" in r.stdout  # (1 + 2) x 64 / 2
    assert "SUMCHECK rank 1 got 96.0 want 96.0" in r.stdout


def test_killing_one_real_rank_fails_the_run_naming_it_without_a_hang(tmp_path):
    script = tmp_path / "dies.py"
    script.write_text(DIES)
    t0 = time.monotonic()
    r = subprocess.run([PY, "-m", "neuronabox.cli", "run", str(CPU64), "--nproc-per-node", "2", "-q",
                        "--", PY, str(script)], capture_output=True, text=True, cwd=ROOT,
                       env={**os.environ, "NBOX_REAL_TIMEOUT": "30"}, timeout=240)
    took = time.monotonic() - t0
    assert r.returncode == 1
    assert "SURVIVED" not in r.stdout
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("nbox: error: real rank 1 (launch rank 1) exited with status 9"), last
    assert took < 90, took


# ---- two machines: two cluster nodes in two network namespaces, torch's c10d rendezvous -----------------
def root_only(test):
    """Marks a test as a root test (namespaces, qdiscs): it runs as root, and is skipped for other users."""
    return pytest.mark.root(pytest.mark.skipif(os.geteuid() != 0, reason="needs root (network namespaces)")(test))


TWO_NODES = """
name: launch-two
cluster: {nodes: 2, ranks_per_node: 4, device: cpu}
network: {type: switch, link: {bandwidth: 1Gbps, latency: 200us}}
emulation: {library: gloo, model: alpha-beta}
"""


@pytest.fixture(scope="module")
def two_machines(tmp_path_factory):
    """A 2-node netns cluster (shaped links through a switch) brought up with ``nbox up``."""
    from neuronabox.cluster import runtime as rt

    gen = private_cluster_state(tmp_path_factory, "nbox-launch-state")
    next(gen)
    path = tmp_path_factory.mktemp("launch") / "two.yaml"
    path.write_text(TWO_NODES)
    name = "lmulti"
    res = rt.up(str(path), runtime="netns", name=name)
    try:
        yield name, path, {h["node"]: h["address"] for h in res.nodes}
    finally:
        rt.down(name)
        next(gen, None)


def _on_both_nodes(name: str, addrs: dict, topo_path, rdzv_id: str, command: list[str], extra=lambda i: [], env=None,
                   backend: str = "c10d"):
    """``nbox exec NODE -- nbox run ... --nnodes 2`` on node0 and node1 at once, each pinned to its own core."""
    cores = sorted(os.sched_getaffinity(0))
    port = 29400 + (os.getpid() + len(rdzv_id)) % 500
    procs = []
    for i, node in enumerate(("node0", "node1")):
        cmd = [PY, "-m", "neuronabox.cli", "exec", node, "--name", name, "--",
               PY, "-m", "neuronabox.cli", "run", str(topo_path), "--nnodes", "2", "--nproc-per-node", "1",
               "--rdzv-backend", backend, "--rdzv-endpoint", f"{addrs['node0']}:{port}", "--rdzv-id", rdzv_id,
               *(["--node-rank", str(i)] if backend == "static" else []), *extra(i), "--", *command]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                                      env={**os.environ, **(env or {})},
                                      preexec_fn=lambda c=cores[i % len(cores)]: os.sched_setaffinity(0, {c})))
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=300)
            outs.append((p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return outs


@root_only
@pytest.mark.parametrize("backend", ["c10d", "static"])
def test_two_namespaces_rendezvous_and_share_the_store(two_machines, tmp_path, backend):
    name, topo_path, addrs = two_machines
    script = tmp_path / "envcheck.py"
    script.write_text(ENVCHECK)
    outs = _on_both_nodes(name, addrs, topo_path, f"envcheck-{backend}", [PY, str(script)], backend=backend)
    rows = {}
    for rc, out, err in outs:
        assert rc == 0, err[-3000:]
        rows.update(_envchecks(out))
    assert set(rows) == {0, 4}  # the first rank of each of the two emulated nodes
    for world_rank, row in rows.items():
        assert row["WORLD_SIZE"] == "8" and row["NBOX_REAL_RANKS"] == "0,4"
        assert row["GROUP_RANK"] == str(world_rank // 4) and row["LOCAL_RANK"] == "0"
        assert row["sum"] == 4.0  # 0 + 4 over gloo between the namespaces, across the shaped link
    host, _ = rows[0]["NBOX_REAL_STORE"].rsplit(":", 1)
    assert host == addrs["node0"] and rows[0]["NBOX_REAL_STORE"] == rows[4]["NBOX_REAL_STORE"]


@root_only
def test_two_namespaces_train_ddp_with_hybrid_collectives(two_machines, tmp_path):
    name, topo_path, addrs = two_machines
    reps = [tmp_path / "node0.json", tmp_path / "node1.json"]
    outs = _on_both_nodes(name, addrs, topo_path, "ddp", [PY, str(DDP), "--steps", "12"],
                          extra=lambda i: ["--report", str(reps[i]), "-q"])
    for rc, out, err in outs:
        assert rc == 0, err[-3000:]
    assert "rank 0 of 8: 12 steps" in outs[0][1] + outs[1][1]
    docs = [json.loads(r.read_text()) for r in reps]
    assert sorted(d["real_rank"] for d in docs) == [0, 4]
    medians = [d["iteration_time"]["median"] for d in docs]
    print(f"two namespaces, DDP 12 steps: medians {[round(m * 1e3, 2) for m in medians]} ms")
    assert max(medians) / min(medians) - 1 < 0.05, medians


@root_only
def test_two_namespaces_a_killed_real_rank_fails_the_other_machine_clearly(two_machines, tmp_path):
    name, topo_path, addrs = two_machines
    script = tmp_path / "dies.py"
    script.write_text(DIES)
    t0 = time.monotonic()
    # No agent spans the two machines: node0's rank must find out through its collectives.
    outs = _on_both_nodes(name, addrs, topo_path, "dies", [PY, str(script)], extra=lambda i: ["-q"],
                          env={"DIE_RANK": "4", "NBOX_REAL_TIMEOUT": "20"})
    took = time.monotonic() - t0
    (rc0, out0, err0), (rc1, out1, err1) = outs
    assert rc1 == 1 and err1.strip().splitlines()[-1] == "nbox: error: real rank 4 (launch rank 1) exited with status 9"
    assert rc0 == 1 and "SURVIVED" not in out0
    assert err0.strip().splitlines()[-1].startswith("nbox: error: real rank 0 (launch rank 0) "), err0[-2000:]
    assert "real rank 4" in err0, err0[-2000:]  # the survivor's own error names the rank that died
    print(f"two namespaces, rank 4 killed: both launchers ended {took:.1f} s after the start")
    assert took < 20 + 60, took


@root_only
def test_cluster_flag_runs_every_real_rank_of_one_node_inside_its_namespace(two_machines, tmp_path):
    name, topo_path, addrs = two_machines
    script = tmp_path / "envcheck.py"
    script.write_text(ENVCHECK)
    r = run_nbox("run", str(topo_path), "--cluster", name, "--nproc-per-node", "2", "--", PY, str(script))
    assert r.returncode == 0, r.stderr[-3000:]
    rows = _envchecks(r.stdout)
    assert set(rows) == {0, 1} and all(row["sum"] == 1.0 for row in rows.values())
    assert rows[0]["NBOX_REAL_STORE"].rsplit(":", 1)[0] == addrs["node0"]  # the agent's store is on node0's address
    r = run_nbox("run", str(topo_path), "--cluster", name, "--nproc-per-node", "1", "--nnodes", "2",
                 "--rdzv-endpoint", f"{addrs['node0']}:29400", "--node-rank", "0", "--", PY, str(script))
    assert r.returncode == 2 and "start one launcher per node" in r.stderr


@root_only
def test_cluster_flag_waits_out_a_busy_agent_and_names_what_stays_broken(two_machines, tmp_path):
    import signal
    import threading

    from neuronabox.cluster.state import ClusterState

    name, topo_path, addrs = two_machines
    script = tmp_path / "envcheck.py"
    script.write_text(ENVCHECK)
    agent = next(p for p in ClusterState.load(name)["processes"] if p.get("role") == "agent")
    # A stopped agent stands for one too busy to answer /health: a loaded machine, not a broken cluster.
    os.kill(agent["pid"], signal.SIGSTOP)
    resume = threading.Timer(3.0, os.kill, (agent["pid"], signal.SIGCONT))
    resume.start()
    try:
        r = run_nbox("run", str(topo_path), "--cluster", name, "--nproc-per-node", "2", "--", PY, str(script))
        assert r.returncode == 0, r.stderr[-3000:]
        os.kill(agent["pid"], signal.SIGSTOP)  # and one that stays silent is refused, naming why
        r = run_nbox("run", str(topo_path), "--cluster", name, "--nproc-per-node", "2", "--", PY, str(script))
        assert r.returncode == 2 and "does not answer" in r.stderr, r.stderr[-2000:]
    finally:
        resume.cancel()
        os.kill(agent["pid"], signal.SIGCONT)
