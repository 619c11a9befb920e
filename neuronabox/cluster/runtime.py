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
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import InputError, RunFailed
from .netns import (DEFAULT_SUBNET, Namespace, build_network, check_cluster_size, ns_pids, plan_network,
                    remove_namespaces, wait_links_up)
from .relay import DEFAULT_PORT
from .shaping import (
    LOSS_CHAIN,
    LinkShape,
    apply_loss,
    apply_rate,
    delay_rules,
    has_netem,
    iptables,
    iptables_restore_parallel,
    kernel_qdiscs,
    loss_rules,
    mechanisms,
)
from .state import ClusterState, default_name, list_clusters, valid_name
from .steering import steer_flows, steering

__all__ = ["up", "down", "status", "exec_in", "doctor", "UpResult", "can_netns", "RUNTIMES"]

RUNTIMES = ("local", "netns", "docker", "auto")
LOCAL_BASE = "127.77.0.0"


@dataclass
class UpResult:
    """What ``up`` made (or found already up)."""

    name: str
    runtime: str
    nodes: list[dict]
    links: list[dict] = field(default_factory=list)
    agent_url: str | None = None
    seconds: float = 0.0
    already_up: bool = False
    notes: list[str] = field(default_factory=list)


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
def _fault_point(phase: str) -> None:
    # Crash tests stop `up` half-way here (NBOX_FAULT_PAUSE=<phase>) and kill -9 it.
    if os.environ.get("NBOX_FAULT_PAUSE") == phase:
        print(f"nbox-fault-pause {phase}", file=sys.stderr, flush=True)
        time.sleep(600)


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
        from .docker_runtime import up as docker_up

        # It checks the engine first (InputError naming the socket, nothing written) and keeps its own state.
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
            broken = _broken(st) if st.get("phase") == "up" else ""
            deadline = time.monotonic() + 3.0
            while "the agent restarts it" in broken and time.monotonic() < deadline:
                # A relay or stub the agent is starting again: back in a second, no rebuild owed.
                time.sleep(0.1)
                broken = _broken(st)
            if st.get("phase") == "up" and not broken:
                if st.get("topology_name") != topo.name or st.get("runtime") != runtime:
                    raise InputError(
                        f"cluster {name!r} is already up with topology {st.get('topology_name')!r} "
                        f"({st.get('runtime')}); run `nbox down {name}` first or pick another --name"
                    )
                return _result(st, already_up=True, notes=notes + [f"cluster {name!r} is already up"])
            if broken:
                kept = _keep_agent_log(st)
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
                _up_netns(st, topo, subnet, shape, rate_kind, agent, say)
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
    return _result(st, seconds=time.perf_counter() - t0, notes=notes)


def _up_local(st: ClusterState, topo) -> None:
    base = int.from_bytes(socket.inet_aton(LOCAL_BASE), "big")
    nodes = [
        {"node": n.name, "ns": None, "address": socket.inet_ntoa((base + 1 + n.index).to_bytes(4, "big")), "index": n.index}
        for n in topo.nodes
    ]
    st.set(plan={"hosts": nodes, "links": [], "subnet": "127.77.0.0/16"}, shapes={})


def _up_netns(st: ClusterState, topo, subnet: str, shape: bool, rate_kind: str, agent: bool, say,
              plan=None, adopt: dict[str, int] | None = None) -> None:
    """The netns runtime's network, shaping and agent; ``plan``/``adopt``: the docker runtime's containers' namespaces."""
    plan = plan or plan_network(topo, st.name, subnet)
    netem = has_netem()
    shapes = {
        lk.id: [LinkShape(lk.rate if shape else 0.0, lk.delay_ab, lk.jitter, lk.loss),
                LinkShape(lk.rate if shape else 0.0, lk.delay_ba, lk.jitter, lk.loss)]
        for lk in plan.links
    }
    if not shape:
        for s in shapes.values():
            for d in s:
                d.delay = d.jitter = d.loss = 0.0
    hosts = [{"node": h.vertex, "ns": h.name, "address": h.address, "index": h.index} for h in plan.hosts]
    st.set(
        plan={
            "subnet": plan.subnet,
            "netem": netem,
            "rate_kind": rate_kind,
            "relay_port": DEFAULT_PORT,
            "hosts": hosts,
            "switches": [{"vertex": p.vertex, "ns": p.name, "address": p.address} for p in plan.namespaces if p.kind == "switch"],
            "links": [lk.as_dict() for lk in plan.links],
            "pair_links": [[a, b, hops] for (a, b), hops in plan.pair_links.items()],
            "paths": [[a, b, p] for (a, b), p in plan.paths.items()],
            "relay_ns": [],
        },
        shapes={str(k): [v[0].as_dict(), v[1].as_dict()] for k, v in shapes.items()},
    )

    def progress(msg: str) -> None:
        say(msg)
        if msg.endswith("namespaces"):
            _fault_point("namespaces")

    build_network(plan, st, progress, adopt=adopt)
    _fault_point("network")

    # Rate: the egress qdisc of each end. Recorded first, like everything else.
    qd = [{"ns": e.ns, "ifname": e.ifname, "kind": rate_kind} for lk in plan.links for e, s in ((lk.a, shapes[lk.id][0]), (lk.b, shapes[lk.id][1])) if s.rate > 0 or netem]
    st.record("qdiscs", qd)
    iprs: dict[str, object] = {}
    try:
        for lk in plan.links:
            for e, s in ((lk.a, shapes[lk.id][0]), (lk.b, shapes[lk.id][1])):
                if s.rate > 0 or (netem and (s.delay or s.jitter or s.loss)):
                    ipr = iprs.get(e.ns) or iprs.setdefault(e.ns, Namespace(e.ns).iproute())
                    apply_rate(ipr, e.index, s, rate_kind, netem=netem)
    finally:
        for ipr in iprs.values():
            ipr.close()
    # Keep each flow in order on the slow links, whichever CPU sends it (steering.py). A new
    # interface is not steered, so only namespaces with something to steer are visited.
    steer_flows({Namespace(ns).path: ifs for ns, ifs in steering(
        ([(lk.a.ns, lk.a.ifname), (lk.b.ns, lk.b.ifname)], shapes[lk.id][0].rate, shapes[lk.id][1].rate) for lk in plan.links).items()
        if any(m != "0" for m in ifs.values())})
    if not netem:
        rules: dict[str, list[list[str]]] = {}
        for lk in plan.links:
            ab, ba = shapes[lk.id]
            for ns, rs in loss_rules(lk, ab.loss, ba.loss).items():
                rules.setdefault(ns, []).extend(rs)
        delayed = _delayed_sources(plan, shapes)
        if (rules or delayed) and not shutil.which("iptables"):
            raise InputError("this topology has link delay or loss and the kernel has no netem, which needs "
                             "iptables (Debian: apt-get install iptables); or use --no-shape")
        st.record("iptables", [{"ns": ns, "chains": LOSS_CHAIN} for ns in rules]
                  + [{"ns": ns, "rule": r} for ns, rs in rules.items() for r in rs])
        for ns, rs in rules.items():
            apply_loss(Namespace(ns), rs, set())
        # Delay without netem: TCP of nodes with a delayed route goes to the agent's relay, their
        # other packets (ICMP, UDP) to its NFQUEUE delay line.
        drules = delay_rules(DEFAULT_PORT, plan.subnet)
        st.record("iptables", [{"ns": ns, "rule": r} for ns in sorted(delayed) for r in drules])
        iptables_restore_parallel([(Namespace(ns), drules) for ns in sorted(delayed)])
        st.data["plan"]["relay_ns"] = sorted(delayed)
        st.save()
    say(f"shaped {sum(1 for s in shapes.values() if s[0].rate > 0)} links ({'netem' if netem else 'tbf/htb; delay by relay (TCP) + nfqueue (ICMP/UDP)'})")
    _fault_point("shaping")
    # Last, so that the kernel's link events settle while the shaping is set up.
    waited = wait_links_up(plan)
    say(f"links up ({waited:.2f} s)")
    if agent:
        _start_agent(st)
        _fault_point("agent")


def _delayed_sources(plan, shapes) -> set[str]:
    out = set()
    for (a, b), hops in plan.pair_links.items():
        if any(shapes[lid][d].delay > 0 or shapes[lid][d].jitter > 0 for lid, d in hops):
            out.add(plan.node_ns[a])
            out.add(plan.node_ns[b])
    return out


def _start_agent(st: ClusterState, timeout: float = 10.0) -> None:
    token = f"nbox-agent-{st.name}-{uuid.uuid4().hex[:12]}"
    cmd = [sys.executable, "-m", "neuronabox.cluster.agent", "--name", st.name, "--token", token]
    st.record("processes", {"role": "agent", "token": token, "cmd": cmd})
    log = open(st.dir / "agent.log", "ab")
    with contextlib.suppress(FileNotFoundError):
        (st.dir / "agent.json").unlink()
    env = {**os.environ, "NBOX_STATE_DIR": str(st.dir.parent)}
    env.pop("NBOX_FAULT_PAUSE", None)
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True, env=env)
    log.close()
    import psutil

    with contextlib.suppress(psutil.Error):
        st.update_process(token, pid=proc.pid, create_time=psutil.Process(proc.pid).create_time())
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        info = _agent_info(st)
        if info and info.get("pid") == proc.pid:
            st.set(agent=info)
            return
        if proc.poll() is not None:
            tail = (st.dir / "agent.log").read_text(errors="replace").strip().splitlines()[-1:] or ["(no output)"]
            raise RunFailed(f"the shaping agent exited with {proc.returncode}: {tail[0]}")
        time.sleep(0.01)
    raise RunFailed(f"the shaping agent did not answer within {timeout:.0f} s (see {st.dir / 'agent.log'})")


def _agent_info(st: ClusterState) -> dict | None:
    try:
        return json.loads((st.dir / "agent.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def _alive(p: dict) -> bool:
    import psutil

    pid = p.get("pid")
    if not pid:
        return False
    try:
        proc = psutil.Process(pid)
        return abs(proc.create_time() - p.get("create_time", proc.create_time())) < 0.01 and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _broken(st: ClusterState) -> str:
    """What makes a cluster unusable (a namespace gone, the agent not running), or '' when nothing does."""
    if st.get("runtime") == "local":
        return ""
    gone = [n["name"] for n in st["namespaces"] if not Namespace(n["name"]).exists()]
    if gone:
        return f"namespace {gone[0]} is gone" + (f", and {len(gone) - 1} more" if len(gone) > 1 else "")
    agents = [p for p in st["processes"] if p.get("role") == "agent"]
    dead = [p for p in agents if not _alive(p)]
    if dead:
        return f"its shaping agent (pid {dead[0].get('pid')}) is not running"
    says = _agent_says(st)
    if "does not answer" in says:
        # Killed a moment ago, it may not have finished dying: say what it will be.
        time.sleep(0.2)
        dead = [p for p in agents if not _alive(p)]
        if dead:
            return f"its shaping agent (pid {dead[0].get('pid')}) is not running"
    # A node's stub: the latest one started for it (a dead one's record stays when another replaces it).
    stubs = {p.get("node"): p for p in st["processes"] if p.get("role") == "stub"}
    dead = [p for p in stubs.values() if not _alive(p)]
    if dead:
        return f"the stub of {dead[0].get('node')} (pid {dead[0].get('pid')}) is not running; the agent restarts it"
    return says


def _agent_says(st: ClusterState, timeout: float = 1.0) -> str:
    """What the agent's /health reports down (a delay relay it is restarting), or '' when all is well."""
    import urllib.error
    import urllib.request

    url = (st.get("agent") or {}).get("url")
    if not url:
        return ""
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=timeout) as r:
            body = json.loads(r.read())
    except urllib.error.HTTPError as exc:  # 503: a part is down
        try:
            body = json.loads(exc.read())
        except ValueError:
            return f"its shaping agent answers /health with {exc.code}"
    except (OSError, ValueError) as exc:
        return f"its shaping agent at {url} does not answer ({exc})"
    down = body.get("down") or []
    return down[0] if down else ""


def _healthy(st: ClusterState) -> bool:
    return not _broken(st)


def _health(st: ClusterState) -> dict:
    """``healthy``, and when it is not, ``problem``: what is down and the command that fixes it."""
    if st.get("phase") != "up":
        return {"healthy": False, "problem": f"phase {st.get('phase')!r}: `nbox down {st.name}` removes what was made"}
    broken = _broken(st)
    if not broken:
        return {"healthy": True, "problem": None}
    if "the agent restarts it" in broken:  # a delay relay: back within a second, nothing to do
        return {"healthy": False, "problem": broken}
    return {"healthy": False, "problem": f"{broken}; `nbox up {st.get('topology')} --name {st.name}` rebuilds it"}


def _keep_agent_log(st: ClusterState) -> Path | None:
    """Copy a broken cluster's agent log beside its state directory, which ``down`` removes: why it died."""
    src = st.dir / "agent.log"
    if not src.is_file():
        return None
    dst = st.dir.parent / f"{st.name}.agent.log"  # the latest broken one per name: a post-mortem, not a history
    with contextlib.suppress(OSError):
        shutil.copyfile(src, dst)
        return dst
    return None


def _result(st: ClusterState, seconds: float = 0.0, already_up: bool = False, notes=()) -> UpResult:
    plan = st.get("plan") or {}
    shapes = st.get("shapes") or {}
    netem = bool(plan.get("netem"))
    links = []
    for lk in plan.get("links", []):
        s = [LinkShape(**d) for d in shapes.get(str(lk["id"]), [{}, {}])]
        links.append({"name": lk["name"], "id": lk["id"], "ab": s[0].as_dict(), "ba": s[1].as_dict(),
                      "mechanisms": mechanisms(s, netem, plan.get("rate_kind", "tbf"))})
    agent = st.get("agent") or {}
    return UpResult(st.name, st.get("runtime"), plan.get("hosts", []), links, agent.get("url"), seconds, already_up, list(notes))


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


def down_network(st: ClusterState, timeout: float = 3.0) -> dict:
    """End the cluster's processes (recorded, by token, inside its namespaces) and delete or unbind its namespaces."""
    import psutil

    names = [n["name"] for n in st["namespaces"]]
    victims: dict[int, psutil.Process] = {}
    for p in st["processes"]:
        if _alive(p):
            with contextlib.suppress(psutil.Error):
                victims[p["pid"]] = psutil.Process(p["pid"])
    tokens = [p["token"] for p in st["processes"] if p.get("token")]
    if tokens:
        # A process recorded before its pid was: find it by the token on its command line.
        for proc in psutil.process_iter(["cmdline"]):
            cmd = " ".join(proc.info.get("cmdline") or [])
            if any(t in cmd for t in tokens):
                victims[proc.pid] = proc
    for pid in ns_pids(names):
        if pid != os.getpid():
            with contextlib.suppress(psutil.Error):
                victims[pid] = psutil.Process(pid)
    victims.pop(os.getpid(), None)
    for proc in victims.values():
        with contextlib.suppress(psutil.Error):
            proc.send_signal(signal.SIGTERM)
    _, alive = psutil.wait_procs(list(victims.values()), timeout=timeout)
    for proc in alive:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    psutil.wait_procs(alive, timeout=timeout)
    removed = remove_namespaces(names)
    return {"processes": len(victims), "namespaces": removed}


# ---- status and exec --------------------------------------------------------------------------------
def status(name: str | None = None) -> list[dict]:
    """One summary per cluster (or for ``name``): runtime, phase, nodes, namespaces present, agent."""
    out = []
    for n in [valid_name(name)] if name else list_clusters():
        st = ClusterState.load(n)
        if st.get("runtime") == "docker":
            from .docker_runtime import status as docker_status

            out.append(docker_status(n))
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
            "agent": (st.get("agent") or {}).get("url") if any(_alive(p) for p in agents) else None,
            **_health(st),
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
            from .netns import RtBatch

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
