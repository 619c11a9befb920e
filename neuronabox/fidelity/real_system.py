"""The real system of ``nbox validate`` and ``nbox calibrate``: a netns cluster and every rank launched on it.

Every rank of the topology runs the user's command in its node's namespace of a netns
cluster (``nbox up``), gloo over the shaped links, ``MASTER_ADDR`` = rank 0's node address,
each rank pinned to its own core. Gloo binds the node address (see ``launch_real`` for why not
``GLOO_SOCKET_IFNAME``). The real rank's iteration times come from the record-only
``sitecustomize`` (``recordonly/``), the real backend untouched.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
import uuid
from pathlib import Path
from typing import Callable, Sequence

from ..errors import InputError

__all__ = [
    "MASTER_PORT", "RECORD_ONLY_DIR", "cluster_for", "cores_shared", "exit_codes_text", "launch_real", "rank_cores",
    "rank_preexec", "rank_ranges", "run_ranks", "stop_process", "twin_ranks",
]

RECORD_ONLY_DIR = Path(__file__).resolve().parent / "recordonly"
MASTER_PORT = 29517


# ---- the cluster and the real ranks ---------------------------------------------------------------
@contextlib.contextmanager
def cluster_for(topology, name: str | None = None, progress: Callable[[str], None] | None = None):
    """A netns cluster of ``topology`` for the duration of the block (taken down after, unless it was up before)."""
    from ..cluster import runtime as rt

    ok, why = rt.can_netns()
    if not ok:
        raise InputError(f"the real system needs a netns cluster: {why}")
    name = name or f"val{uuid.uuid4().hex[:6]}"
    res = rt.up(topology, runtime="netns", name=name, progress=progress)
    try:
        yield res
    finally:
        if not res.already_up:
            rt.down(name)


def rank_cores(world: int) -> list[int]:
    """The core each rank is pinned to: its own core while there are enough, round robin after (node k's CPU for rank k)."""
    from ..cluster.steering import node_cpu

    return [node_cpu(r) for r in range(world)]


def cores_shared(world: int) -> int | None:
    """The cores ``world`` pinned ranks get here when there are fewer than ranks (round robin), else None."""
    cores = len(set(rank_cores(world)))
    return cores if world > cores else None


def rank_ranges(ranks: Sequence[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``0-2, 5``: a 64-rank list in a line."""
    out: list[str] = []
    xs = sorted(set(ranks))
    i = 0
    while i < len(xs):
        j = i
        while j + 1 < len(xs) and xs[j + 1] == xs[j] + 1:
            j += 1
        out.append(str(xs[i]) if i == j else f"{xs[i]}-{xs[j]}")
        i = j + 1
    return ", ".join(out)


def exit_codes_text(codes: Sequence[int]) -> str:
    """Every rank's exit status, grouped by status: ``1 on ranks 0-63`` or ``0 on ranks 0, 2-7; -9 on rank 1``."""
    by_code: dict[int, list[int]] = {}
    for rank, code in enumerate(codes):
        by_code.setdefault(code, []).append(rank)
    return "; ".join(f"{code} on rank{'s' if len(rs) > 1 else ''} {rank_ranges(rs)}" for code, rs in by_code.items())


def twin_ranks(world: int, real_rank: int) -> list[tuple[int, int]]:
    """The load twin: (rank, core) of every rank of the real system other than the emulated run's real rank."""
    cores = rank_cores(world)
    return [(r, cores[r]) for r in range(world) if r != real_rank]


def _node_iface(plan: dict, ns: str) -> str:
    for lk in plan.get("links", []):
        for end in (lk["a"], lk["b"]):
            if end["ns"] == ns and end.get("addr"):
                return end["ifname"]
    raise InputError(f"node namespace {ns} has no addressed interface for gloo (GLOO_SOCKET_IFNAME)")


CLONE_NEWUTS = 0x04000000


def rank_preexec(ns_path: str | None, core: int | None, hostname: str | None = None):
    """What a rank's process does before it runs: enter its node's namespace, take its hostname and core, lead its own process group."""
    import ctypes

    from ..cluster.namespace import Namespace

    enter = Namespace(os.path.basename(ns_path)).preexec() if ns_path else None
    libc = ctypes.CDLL(None, use_errno=True) if hostname else None
    name = hostname.encode() if hostname else b""

    def pre() -> None:
        if enter is not None:
            enter()
        if libc is not None:
            # gloo without GLOO_SOCKET_IFNAME binds the address its hostname resolves to: a
            # private UTS namespace whose hostname is the node address makes that the node
            # address, the one the delay relay knows (see launch_real).
            if libc.unshare(CLONE_NEWUTS) != 0 or libc.sethostname(name, len(name)) != 0:
                os._exit(126)
        if core is not None:
            os.sched_setaffinity(0, {core})
        # Its own process group, so that a timeout can end the rank and all its children.
        os.setpgid(0, 0)

    return pre


def launch_real(
    cluster: str,
    topology,
    command: Sequence[str],
    record: Path | None = None,
    *,
    timeout: float = 600.0,
    extra_env: dict[str, str] | None = None,
    record_only: bool = True,
    log_dir: Path | None = None,
    gloo_bind: str = "node",
    record_rank: int = 0,
) -> tuple[int, list[int]]:
    """Run ``command`` as every rank of ``topology`` in the nodes of ``cluster``; ``record_rank`` records to ``record``.

    ``gloo_bind``: ``node`` makes gloo bind the node address (on ``lo``); ``iface`` sets
    ``GLOO_SOCKET_IFNAME`` to the node's NIC, so gloo binds that link's address. Both cross
    the same shaped veth, but without netem the delay relay knows routes by node address
    only, so with ``iface`` gloo's connections get the rate and not the delay (measured: a
    4 B all-reduce over a 1 ms link in 0.4 ms). Returns the first non-zero exit status (0
    if every rank succeeded) and every rank's status.
    """
    if gloo_bind not in ("node", "iface"):
        raise ValueError(f"gloo_bind: node or iface, got {gloo_bind!r}")
    from ..cluster.state import ClusterState
    from ..emu.environ import child_pythonpath

    st = ClusterState.load(cluster)
    plan = st.get("plan") or {}
    hosts = {h["node"]: h for h in plan.get("hosts", [])}
    world = topology.world_size
    cores = rank_cores(world)
    master = hosts[topology.nodes[topology.rank_node[0]].name]
    base = {k: v for k, v in os.environ.items() if not k.startswith("NBOX_") and k not in ("PYTHONPATH",)}
    pythonpath = child_pythonpath(*([RECORD_ONLY_DIR] if record_only else []))
    envs, preexecs = [], []
    for rank in range(world):
        node = topology.nodes[topology.rank_node[rank]]
        h = hosts[node.name]
        env = dict(base)
        env.update(extra_env or {})
        env.update({
            "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(topology.local_rank(rank)),
            "LOCAL_WORLD_SIZE": str(node.ranks), "GROUP_RANK": str(node.index),
            "GROUP_WORLD_SIZE": str(len(topology.nodes)), "MASTER_ADDR": master["address"],
            "MASTER_PORT": str(MASTER_PORT),
            "TORCHELASTIC_RUN_ID": f"nbox-validate-{cluster}", "PYTHONPATH": pythonpath,
            "NBOX_CLUSTER": cluster, "NBOX_NODE": node.name, "NBOX_NODE_ADDR": h["address"],
        })
        env.pop("GLOO_SOCKET_IFNAME", None)
        if gloo_bind == "iface":
            env["GLOO_SOCKET_IFNAME"] = _node_iface(plan, h["ns"])
        if record_only:
            env["NBOX_RECORD_ONLY"] = "1"
        if rank == record_rank and record is not None:
            env["NBOX_RECORD"] = str(record)
        envs.append(env)
        preexecs.append(rank_preexec(f"/run/netns/{h['ns']}" if h.get("ns") else None, cores[rank],
                                     h["address"] if gloo_bind == "node" and h.get("ns") else None))
    codes = run_ranks(command, envs, preexecs, timeout=timeout, log_dir=log_dir)
    bad = next((c for c in codes if c != 0), 0)
    return bad, codes


def run_ranks(command: Sequence[str], envs: Sequence[dict[str, str]], preexecs: Sequence[Callable[[], None]], *,
              timeout: float, log_dir: Path | None = None) -> list[int]:
    """Run ``command`` once per rank (``envs[r]``, ``preexecs[r]``, output to ``log_dir/rank<r>.log``) and return every rank's exit status.

    Each preexec must give its process a process group of its own (``rank_preexec`` does): a
    rank that fails, or outlives ``timeout``, is ended with its children.
    """
    procs: list[subprocess.Popen] = []
    logs = []
    try:
        for rank, (env, pre) in enumerate(zip(envs, preexecs)):
            out = open(log_dir / f"rank{rank}.log", "wb") if log_dir else subprocess.DEVNULL
            if log_dir:
                logs.append(out)
            try:
                procs.append(subprocess.Popen(list(command), env=env, stdin=subprocess.DEVNULL, stdout=out,
                                              stderr=subprocess.STDOUT, preexec_fn=pre))
            except FileNotFoundError:
                raise InputError(f"command not found: {command[0]!r}") from None
        codes = _wait_all(procs, timeout)
    finally:
        for p in procs:
            stop_process(p)
        for f in logs:
            f.close()
    return codes


def _wait_all(procs: list[subprocess.Popen], timeout: float) -> list[int]:
    # A rank that fails leaves the others blocked in a collective: end them after a grace period.
    deadline = time.monotonic() + timeout
    failed_at = None
    while True:
        codes = [p.poll() for p in procs]
        if all(c is not None for c in codes):
            return codes  # type: ignore[return-value]
        if failed_at is None and any(c not in (None, 0) for c in codes):
            failed_at = time.monotonic()
        now = time.monotonic()
        if now > deadline or (failed_at is not None and now - failed_at > 10):
            for p in procs:
                stop_process(p)
            return [p.returncode if p.returncode is not None else -9 for p in procs]
        time.sleep(0.05)


def stop_process(p: subprocess.Popen) -> None:
    """End ``p`` and its process group if it is still running."""
    if p.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(p.pid, signal.SIGTERM)
    try:
        p.wait(timeout=5)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()
