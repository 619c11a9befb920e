"""A netns cluster's making and unmaking: build it (plan, namespaces, veths, qdiscs, relays, the agent), judge its health, end it.

Both runtimes that shape links use it: ``netns`` builds namespaces of its own, ``docker`` adopts
its node containers' namespaces first (``docker_runtime.py``). ``runtime.py`` chooses between
runtimes above it; nothing here imports a runtime.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import InputError, RunFailed
from .namespace import Namespace, ns_pids, remove_namespaces
from .netns import build_network, wait_links_up
from .netplan import plan_network
from .relay import DEFAULT_PORT
from .shaping import (
    LOSS_CHAIN,
    LinkShape,
    apply_loss,
    apply_rate,
    delay_rules,
    has_netem,
    iptables_restore_parallel,
    loss_rules,
    mechanisms,
)
from .state import ClusterState
from .steering import steer_flows, steering

__all__ = ["UpResult", "fault_point", "up_netns", "process_alive", "what_is_broken", "health", "up_result", "keep_agent_log", "down_network"]


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


def fault_point(phase: str) -> None:
    # Crash tests stop `up` half-way here (NBOX_FAULT_PAUSE=<phase>) and kill -9 it.
    if os.environ.get("NBOX_FAULT_PAUSE") == phase:
        print(f"nbox-fault-pause {phase}", file=sys.stderr, flush=True)
        time.sleep(600)


def up_netns(st: ClusterState, topo, subnet: str, shape: bool, rate_kind: str, agent: bool, say,
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
            fault_point("namespaces")

    build_network(plan, st, progress, adopt=adopt)
    fault_point("network")

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
    fault_point("shaping")
    # Last, so that the kernel's link events settle while the shaping is set up.
    waited = wait_links_up(plan)
    say(f"links up ({waited:.2f} s)")
    if agent:
        _start_agent(st)
        fault_point("agent")


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


def process_alive(p: dict) -> bool:
    import psutil

    pid = p.get("pid")
    if not pid:
        return False
    try:
        proc = psutil.Process(pid)
        return abs(proc.create_time() - p.get("create_time", proc.create_time())) < 0.01 and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def what_is_broken(st: ClusterState) -> str:
    """What makes a cluster unusable (a namespace gone, the agent not running), or '' when nothing does."""
    if st.get("runtime") == "local":
        return ""
    gone = [n["name"] for n in st["namespaces"] if not Namespace(n["name"]).exists()]
    if gone:
        return f"namespace {gone[0]} is gone" + (f", and {len(gone) - 1} more" if len(gone) > 1 else "")
    agents = [p for p in st["processes"] if p.get("role") == "agent"]
    dead = [p for p in agents if not process_alive(p)]
    if dead:
        return f"its shaping agent (pid {dead[0].get('pid')}) is not running"
    says = _agent_says(st)
    if "does not answer" in says:
        # Killed a moment ago, it may not have finished dying: say what it will be.
        time.sleep(0.2)
        dead = [p for p in agents if not process_alive(p)]
        if dead:
            return f"its shaping agent (pid {dead[0].get('pid')}) is not running"
    # A node's stub: the latest one started for it (a dead one's record stays when another replaces it).
    stubs = {p.get("node"): p for p in st["processes"] if p.get("role") == "stub"}
    dead = [p for p in stubs.values() if not process_alive(p)]
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
    return not what_is_broken(st)


def _passing(broken: str) -> bool:
    """A fault that mends itself: a relay or stub the agent is starting again, an agent too busy to answer in time."""
    return "the agent restarts it" in broken or "does not answer" in broken


def settled_broken(st: ClusterState, settle: float = 0.0) -> str:
    """``what_is_broken``, asked again for up to ``settle`` seconds while the fault is one that mends itself."""
    broken = what_is_broken(st)
    deadline = time.monotonic() + settle
    while broken and _passing(broken) and time.monotonic() < deadline:
        time.sleep(0.1)
        broken = what_is_broken(st)
    return broken


def health(st: ClusterState, settle: float = 0.0) -> dict:
    """``healthy``, and when it is not, ``problem``: what is down and the command that fixes it."""
    if st.get("phase") != "up":
        return {"healthy": False, "problem": f"phase {st.get('phase')!r}: `nbox down {st.name}` removes what was made"}
    broken = settled_broken(st, settle)
    if not broken:
        return {"healthy": True, "problem": None}
    if "the agent restarts it" in broken:  # a delay relay: back within a second, nothing to do
        return {"healthy": False, "problem": broken}
    return {"healthy": False, "problem": f"{broken}; `nbox up {st.get('topology')} --name {st.name}` rebuilds it"}


def keep_agent_log(st: ClusterState) -> Path | None:
    """Copy a broken cluster's agent log beside its state directory, which ``down`` removes: why it died."""
    src = st.dir / "agent.log"
    if not src.is_file():
        return None
    dst = st.dir.parent / f"{st.name}.agent.log"  # the latest broken one per name: a post-mortem, not a history
    with contextlib.suppress(OSError):
        shutil.copyfile(src, dst)
        return dst
    return None


def up_result(st: ClusterState, seconds: float = 0.0, already_up: bool = False, notes=()) -> UpResult:
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


def down_network(st: ClusterState, timeout: float = 3.0) -> dict:
    """End the cluster's processes (recorded, by token, inside its namespaces) and delete or unbind its namespaces."""
    import psutil

    names = [n["name"] for n in st["namespaces"]]
    victims: dict[int, psutil.Process] = {}
    for p in st["processes"]:
        if process_alive(p):
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
