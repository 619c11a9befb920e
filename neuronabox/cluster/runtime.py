"""Lifecycle of an emulation cluster: ``up``, ``down``, ``status``, ``exec_in``, ``doctor``.

Runtimes:
- ``netns``: a namespace per node and per switch (``netns.py``), shaped veths
  (``shaping.py``), a shaping agent with the delay relay (``agent.py``). Needs root or
  CAP_NET_ADMIN.
- ``local``: no isolation and no shaping; nodes are loopback addresses (127.77.x.y), which
  any user can bind. What ``auto`` falls back to without privileges.
- ``docker``: needs a Docker engine; refused with a clear message when none answers.

Everything ``up`` creates is recorded in the state file first (``state.py``), so ``down``
works after a crash or a ``kill -9`` of ``up``: it ends the cluster's processes (recorded
pids, the agent's command-line token, and every process inside the cluster's namespaces),
then deletes the namespaces, which takes every veth, bridge, qdisc, route and iptables
rule inside them along (none of them lives in the root namespace).
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import time
from pathlib import Path

from ..errors import InputError
from .namespace import Namespace
from .netplan import DEFAULT_SUBNET, check_cluster_size
from .netns_cluster import (
    UpResult,
    down_network,
    health,
    keep_agent_log,
    process_alive,
    settled_broken,
    up_netns,
    up_result,
    what_is_broken,
)
from .shaping import (
    iptables,
    kernel_qdiscs,
)
from .state import ClusterState, default_name, list_clusters, valid_name

__all__ = ["up", "down", "status", "exec_in", "doctor", "UpResult", "can_netns", "RUNTIMES"]

RUNTIMES = ("local", "netns", "docker", "auto")
LOCAL_BASE = "127.77.0.0"


# ---- privileges and engines ---------------------------------------------------------------------
def _cap_net_admin() -> bool:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("CapEff:"):
                return bool(int(line.split()[1], 16) & (1 << 12))
    except OSError:
        pass
    return os.geteuid() == 0


def can_netns() -> tuple[bool, str]:
    """Whether this process may build a netns cluster, and why not."""
    if not _cap_net_admin():
        return False, "needs root or CAP_NET_ADMIN"
    if not Path("/proc/self/ns/net").exists():
        return False, "this kernel has no network namespaces"
    return True, ""


def docker_engine() -> tuple[bool, str]:
    """Whether a Docker engine answers (the Docker SDK if installed, else the socket's /_ping)."""
    from .docker_runtime import engine_answers

    return engine_answers()


# ---- up -------------------------------------------------------------------------------------------


def up(
    topology,
    runtime: str = "auto",
    name: str | None = None,
    subnet: str = DEFAULT_SUBNET,
    shape: bool = True,
    rate_kind: str = "tbf",
    agent: bool = True,
    progress=None,
) -> UpResult:
    """Bring a cluster up for ``topology`` (a path or a loaded Topology); safe to call twice."""
    from ..topology import Topology, load_topology

    topo = topology if isinstance(topology, Topology) else load_topology(topology, profile_may_be_missing=True)
    name = valid_name(name) if name else default_name(topo.name)
    say = progress or (lambda msg: None)
    if runtime not in RUNTIMES:
        raise InputError(f"--runtime: expected one of {', '.join(RUNTIMES)}, got {runtime!r}")
    if rate_kind not in ("tbf", "htb"):
        raise InputError(f"--rate-qdisc: expected tbf or htb, got {rate_kind!r}")
    notes: list[str] = []
    if runtime == "auto":
        ok, why = can_netns()
        runtime = "netns" if ok else "local"
        if not ok:
            notes.append(f"runtime auto: falling back to local ({why}); links are not shaped")
            say(notes[-1])
    if runtime in ("netns", "docker"):
        check_cluster_size(topo)  # before any state, lock or engine is touched
    if runtime == "docker":
        from .docker_runtime import engine_or_fail
        from .docker_runtime import up as docker_up

        # Before anything is written: the engine (InputError naming the socket, or its refusal of this
        # user), then the privileges the links need. A member of the engine's group may start
        # containers, but not build links in their namespaces. docker_up keeps its own state.
        engine_or_fail()
        ok, why = can_netns()
        if not ok:
            raise InputError(f"--runtime docker: {why} (the links are built in the containers' namespaces); run as root")
        return docker_up(topo, name=name, subnet=subnet, progress=progress)
    if runtime == "netns":
        ok, why = can_netns()
        if not ok:
            raise InputError(f"--runtime netns: {why}; run as root, or use --runtime local")

    t0 = time.perf_counter()
    st = ClusterState(name)
    # The lock makes a second `up` of the same name wait, then find the cluster up.
    with st.locked():
        if st.path.exists():
            # A relay or stub the agent is starting again is back in a second: no rebuild owed.
            broken = settled_broken(st, 3.0) if st.get("phase") == "up" else ""
            if st.get("phase") == "up" and not broken:
                if st.get("topology_name") != topo.name or st.get("runtime") != runtime:
                    raise InputError(
                        f"cluster {name!r} is already up with topology {st.get('topology_name')!r} "
                        f"({st.get('runtime')}); run `nbox down {name}` first or pick another --name"
                    )
                return up_result(st, already_up=True, notes=notes + [f"cluster {name!r} is already up"])
            if broken:
                kept = keep_agent_log(st)
                say(f"cluster {name!r} is broken ({broken}); removing it first"
                    + (f" (its agent's log: {kept})" if kept else ""))
            else:
                say(f"cluster {name!r} was left half made (phase {st.get('phase')!r}); removing it first")
            down(name, keep_lock=True)
            st = ClusterState(name)
        try:
            st.set(
                phase="creating", runtime=runtime, topology=str(topo.source), topology_name=topo.name,
                subnet=subnet, created=time.time(), pid=os.getpid(),
            )
            if runtime == "local":
                _up_local(st, topo)
            else:
                up_netns(st, topo, subnet, shape, rate_kind, agent, say)
            if agent:
                # Stub peers hook (wire mode, stub.py): one per ring neighbour of the real ranks,
                # recorded in the state before it starts, so `down` ends it like the agent.
                from .stub import neighbour_nodes, start_stubs

                start_stubs(st, neighbour_nodes(topo))
            st.set(phase="up", up_seconds=time.perf_counter() - t0)
            if runtime == "netns" and shape and agent:
                # Said at up, not found later in a ping: what delay the links really give here.
                from .delay_probe import delay_note

                note = delay_note(st.data)
                if note:
                    notes.append(note)
        except BaseException:
            # A failed `up` takes back what it made, so no `down` is owed.
            with contextlib.suppress(Exception):
                down(name, keep_lock=True)
            raise
        finally:
            if not st.path.exists():
                st.remove_files()
    return up_result(st, seconds=time.perf_counter() - t0, notes=notes)


def _up_local(st: ClusterState, topo) -> None:
    base = int.from_bytes(socket.inet_aton(LOCAL_BASE), "big")
    nodes = [
        {"node": n.name, "ns": None, "address": socket.inet_ntoa((base + 1 + n.index).to_bytes(4, "big")), "index": n.index}
        for n in topo.nodes
    ]
    st.set(plan={"hosts": nodes, "links": [], "subnet": "127.77.0.0/16"}, shapes={})


# ---- down -----------------------------------------------------------------------------------------
def down(name: str, timeout: float = 3.0, keep_lock: bool = False, progress=None) -> dict:
    """Remove everything cluster ``name`` made, from its state file (works after a crash).

    ``keep_lock``: the caller (``up``) holds the cluster's lock. Otherwise ``down`` takes it, so
    that it waits for an ``up`` of the same name to finish (or to die: the lock goes with its
    process) instead of pulling namespaces from under it; ``progress`` hears that it waits.
    """
    if keep_lock:
        return _down(name, timeout, keep_lock=True)
    st = ClusterState.load(valid_name(name))  # InputError for a cluster that does not exist, before a lock is made
    try:
        with ClusterState(name).locked(blocking=False):
            return _down(name, timeout, keep_lock=False)
    except BlockingIOError:
        pass
    if progress is not None:
        progress(f"cluster {name!r} is busy (`nbox up` pid {st.get('pid')}, or a change through its agent): "
                 "waiting for it to finish")
    with ClusterState(name).locked():
        return _down(name, timeout, keep_lock=False)


def _down(name: str, timeout: float, keep_lock: bool) -> dict:
    st = ClusterState.load(valid_name(name))
    if st.get("runtime") == "docker":
        from .docker_runtime import down as docker_down

        return docker_down(name, keep_lock=keep_lock)
    out = down_network(st, timeout)
    st.remove_files(keep_lock=keep_lock)
    return {"name": name, **out}


# ---- status and exec --------------------------------------------------------------------------------
def status(name: str | None = None, settle: float = 0.0) -> list[dict]:
    """One summary per cluster (or for ``name``): runtime, phase, nodes, namespaces present, agent.

    ``settle``: how long to wait out a fault that mends itself (a relay restarting, a busy agent)
    before calling the cluster unhealthy.
    """
    out = []
    for n in [valid_name(name)] if name else list_clusters():
        st = ClusterState.load(n)
        if st.get("runtime") == "docker":
            from .docker_runtime import status as docker_status

            out.append(docker_status(n, settle))
            continue
        plan = st.get("plan") or {}
        present = sum(1 for x in st["namespaces"] if Namespace(x["name"]).exists())
        agents = [p for p in st["processes"] if p.get("role") == "agent"]
        out.append({
            "name": n,
            "runtime": st.get("runtime"),
            "phase": st.get("phase"),
            "topology": st.get("topology"),
            "nodes": len(plan.get("hosts", [])),
            "links": len(plan.get("links", [])),
            "namespaces": f"{present}/{len(st['namespaces'])}",
            "agent": (st.get("agent") or {}).get("url") if any(process_alive(p) for p in agents) else None,
            **health(st, settle),
        })
    return out


def node_info(name: str, node: str) -> dict:
    """The host entry (node, ns, address) of ``node`` (a node name or index) in cluster ``name``."""
    st = ClusterState.load(valid_name(name))
    hosts = (st.get("plan") or {}).get("hosts", [])
    for h in hosts:
        if h["node"] == node or str(h["index"]) == str(node):
            return {**h, "runtime": st.get("runtime")}
    raise InputError(f"cluster {name!r} has no node {node!r} (nodes: {', '.join(h['node'] for h in hosts[:8])}{', …' if len(hosts) > 8 else ''})")


def exec_in(name: str, node: str, cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    """Run ``cmd`` inside node ``node`` of cluster ``name`` (its namespace, or locally for `local`)."""
    if not cmd:
        raise InputError("exec: no command given (nbox exec NODE -- CMD ...)")
    h = node_info(name, node)
    if h["runtime"] == "docker":
        from .docker_runtime import exec_in as docker_exec

        # Inside the node's container, with its environment (the host's would be wrong there).
        return docker_exec(name, h, cmd, env=kwargs.pop("env", {}), **kwargs)
    env = {**os.environ, **kwargs.pop("env", {}), "NBOX_CLUSTER": name, "NBOX_NODE": h["node"], "NBOX_NODE_ADDR": h["address"]}
    pre = Namespace(h["ns"]).preexec() if h.get("ns") else None
    try:
        return subprocess.run(cmd, env=env, preexec_fn=pre, **kwargs)
    except FileNotFoundError:
        raise InputError(f"exec: command not found: {cmd[0]!r}") from None


def popen_in(name: str, node: str, cmd: list[str], **kwargs) -> subprocess.Popen:
    """Start ``cmd`` inside a node without waiting (for servers and stub peers)."""
    h = node_info(name, node)
    env = {**os.environ, **kwargs.pop("env", {}), "NBOX_CLUSTER": name, "NBOX_NODE": h["node"], "NBOX_NODE_ADDR": h["address"]}
    pre = Namespace(h["ns"]).preexec() if h.get("ns") else None
    return subprocess.Popen(cmd, env=env, preexec_fn=pre, **kwargs)


# ---- doctor -------------------------------------------------------------------------------------------
def doctor() -> list[dict]:
    """What this host can do for `nbox up`: one row per check (name, ok, detail)."""
    rows: list[dict] = []

    def row(check: str, ok: bool | None, detail: str = "") -> None:
        rows.append({"check": check, "ok": ok, "detail": detail})

    cap = _cap_net_admin()
    row("privileges", cap, f"euid {os.geteuid()}, CAP_NET_ADMIN {'yes' if cap else 'no'}")
    scratch = None
    if cap:
        scratch = Namespace(f"nbx-doctor-{os.getpid()}")
        try:
            scratch.create()
            row("network namespaces", True, "create, enter, delete")
        except OSError as exc:
            row("network namespaces", False, str(exc))
            scratch = None
    else:
        row("network namespaces", None, "not checked (needs root)")
    if scratch is not None:
        try:
            from .rtnetlink import RtBatch

            b = RtBatch(scratch)
            b.veth("dva", 2, "dvb", 3, os.open(scratch.path, os.O_RDONLY | os.O_CLOEXEC))
            b.bridge("dbr", 4)
            b.commit()
            b.close()
            row("veth, bridge", True, "")
        except OSError as exc:
            row("veth, bridge", False, str(exc))
        try:
            q = kernel_qdiscs()
            for kind, ok in q.items():
                row(f"qdisc {kind}", ok, "" if ok else "not in this kernel")
        except OSError as exc:
            row("qdiscs", False, str(exc))
        from shutil import which

        if which("iptables"):
            ver = subprocess.run(["iptables", "--version"], capture_output=True, text=True).stdout.strip()
            row("iptables", True, ver)
            probes = {
                "REDIRECT": ["-t", "nat", "-A", "OUTPUT", "-p", "tcp", "-j", "REDIRECT", "--to-ports", "1"],
                "TPROXY": ["-t", "mangle", "-A", "PREROUTING", "-p", "tcp", "-j", "TPROXY", "--on-port", "1", "--tproxy-mark", "1"],
                "NFQUEUE": ["-A", "OUTPUT", "-j", "NFQUEUE", "--queue-num", "1", "--queue-bypass"],
                "statistic match": ["-A", "OUTPUT", "-m", "statistic", "--mode", "random", "--probability", "0.5", "-j", "DROP"],
                "mark match": ["-A", "OUTPUT", "-m", "mark", "--mark", "1", "-j", "ACCEPT"],
            }
            for label, args in probes.items():
                r = iptables(scratch, args, check=False)
                row(f"iptables {label}", r.returncode == 0, (r.stderr.strip().splitlines() or [""])[0])
        else:
            row("iptables", False, "no iptables binary (Debian: apt-get install iptables); loss and the delay relay need it")
        try:
            from .nfqueue import NfQueue

            NfQueue(scratch).close()
            row("nfnetlink_queue", True, "a queue binds (the ICMP/UDP delay line)")
        except OSError as exc:
            row("nfnetlink_queue", False, str(exc))
        scratch.delete()
    netem = False
    with contextlib.suppress(OSError, KeyError):
        netem = cap and kernel_qdiscs()["netem"]
    row("delay mechanism", True, "netem" if netem else "user-space (no netem): relay for TCP + NFQUEUE delay line for ICMP/UDP; "
        "rate by tbf/htb, loss by iptables statistic")
    ok, detail = docker_engine()
    row("docker engine", ok, detail)
    gpu = [p for p in ("/dev/nvidiactl", "/dev/nvidia0") if os.path.exists(p)]
    row("GPU", bool(gpu), ", ".join(gpu) if gpu else "no /dev/nvidia*")
    ok, why = can_netns()
    row("runtime auto", True, "netns" if ok else f"local ({why})")
    return rows
