"""The docker runtime of ``nbox up``: the compose project of ``compose.py``, run by a Docker engine.

Host side (``up``, ``down``, ``status``, ``exec_in``): the project is rendered into the cluster's
state directory (``<state>/<name>/compose/``) and its node services are started through the Docker
SDK (``pip install 'neuronabox[docker]'``, imported lazily), the one way neuronabox talks to the
engine (``client()``), with no network (``network_mode: none``). Each container's network
namespace is then bound by its pid to the name the netns runtime uses (``Namespace.adopt``) and
``netns_cluster.up_netns`` builds the topology in them: the same plan, veths, switch namespaces,
tbf/htb, loss rules, delay relays and shaping agent as ``--runtime netns``, so links mean the same
on both runtimes. Images come from ``nbox images build`` (``images.py``). As for the other
runtimes, the state file names every object before it is created (the ``docker`` field: driver,
project, containers; the netns kinds for the rest) and every container carries the label
``nbox.cluster=<name>``, so ``down`` removes everything after a crash or a ``kill -9`` of ``up``,
and a failed ``up`` takes back what it made. No engine answering is an InputError that names the
socket, raised before anything is written.

Container side (``python -m neuronabox.cluster.docker_runtime agent``): the shaping agent of
the ``nbox compose`` project only (compose cannot bind namespaces or run host relays). All nodes
share one bridge, so a node's link is its ``eth0``; the agent
finds each node's processes (it runs with ``pid: host``) by ``NBOX_CLUSTER``/``NBOX_NODE`` in
their environment, enters ``/proc/<pid>/ns/net`` and puts tbf (and netem where the host
kernel has it) on ``eth0`` through netlink. It serves ``GET /health``, ``GET /links``,
``POST /links/<node>`` (the body of the netns agent's API) and ``GET /metrics`` on every
interface of its container, for Prometheus on the cluster network.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Sequence

from ..errors import InputError, RunFailed
from .state import ClusterState, default_name, valid_name
from .steering import steer_flows, steering

__all__ = ["up", "down", "status", "exec_in", "client", "engine_or_fail", "engine_answers", "docker_sdk", "DockerAgent",
           "main"]

LABEL = "nbox.cluster"


# ---- the engine ----------------------------------------------------------------------------------
def docker_sdk():
    """The Docker SDK module, or None (a checkout's ``docker/`` folder imports as an empty namespace package)."""
    try:
        import docker  # type: ignore
    except ImportError:
        return None
    return docker if hasattr(docker, "from_env") else None


def _docker_host() -> str:
    return os.environ.get("DOCKER_HOST") or "unix:///var/run/docker.sock"


def _refused_user(host: str) -> tuple[str, str] | None:
    """(user, group) when the engine's unix socket refuses this user (EACCES on connect), else None."""
    import grp
    import pwd
    import socket

    if not host.startswith("unix://"):
        return None
    path = host[len("unix://"):]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(2)
            s.connect(path)
    except PermissionError:
        # The engine is there; its socket is root's and its group's (root:docker 660 as Debian ships it).
        try:
            group = grp.getgrgid(os.stat(path).st_gid).gr_name
        except (OSError, KeyError):
            group = "docker"
        try:
            user = pwd.getpwuid(os.geteuid()).pw_name
        except KeyError:
            user = f"uid {os.geteuid()}"
        return user, group
    except OSError:
        return None  # no engine there, or another fault: engine_answers says which
    return None


def engine_refusal(host: str | None = None) -> str | None:
    """Why the engine at ``host`` refuses this user (not root, not in the socket's group), or None."""
    host = host or _docker_host()
    who = _refused_user(host)
    return _refusal(host, *who) if who else None


def _refusal(host: str, user: str, group: str) -> str:
    return (f"the Docker engine at {host} refuses user {user} "
            f"(permission denied on {host[len('unix://'):]}, which is root's and group {group}'s)")


def engine_answers() -> tuple[bool, str]:
    """Whether a Docker engine answers at $DOCKER_HOST (default the unix socket), and where or why not."""
    host = _docker_host()
    refused = engine_refusal(host)
    if refused:
        return False, refused
    sdk = docker_sdk()
    if sdk is not None:
        try:
            sdk.from_env(timeout=2).ping()
            return True, host
        except Exception as exc:  # noqa: BLE001 - any failure means no usable engine
            first = (str(exc).splitlines() or [""])[0]
            return False, f"{host}: {type(exc).__name__}{': ' + first if first else ''}"
    if not host.startswith("unix://"):
        return False, f"{host}: the Docker SDK (pip install 'neuronabox[docker]') is needed for a TCP engine"
    import socket

    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(2)
            s.connect(host[len("unix://"):])
            s.sendall(b"GET /_ping HTTP/1.0\r\nHost: docker\r\n\r\n")
            reply = s.recv(64)
    except OSError as exc:
        return False, f"{host}: {exc.strerror or exc}"
    return (b" 200 " in reply), (host if b" 200 " in reply else f"{host}: /_ping answered {reply[:20]!r}")


def engine_or_fail(what: str = "--runtime docker") -> str:
    """The Docker host that answers; InputError (one line, naming the socket) when none does or it refuses us."""
    host = _docker_host()
    who = _refused_user(host)
    if who:
        user, group = who
        if what == "--runtime docker":
            # `up` also builds the links in the containers' namespaces, which the group does not allow.
            advice = "run nbox up as root (the docker runtime also shapes links in the containers' namespaces)"
        else:
            advice = f"add {user} to group {group} (usermod -aG {group} {user}, then log in again) or run as root"
        raise InputError(f"{what}: {_refusal(host, user, group)}; {advice}")
    ok, detail = engine_answers()
    if not ok:
        hint = "; use --runtime netns or local" if what == "--runtime docker" else ""
        raise InputError(f"{what}: no Docker engine answers ({detail}){hint}")
    return detail


def client(timeout: int = 120, what: str = "--runtime docker"):
    """A Docker SDK client of an engine that answers; InputError (one line) for no SDK, no engine or a refusal."""
    sdk = docker_sdk()
    if sdk is None:
        raise InputError(f"{what}: the Docker SDK is not installed (pip install 'neuronabox[docker]')")
    engine_or_fail(what)
    return sdk.from_env(timeout=timeout)


def _client(timeout: int = 30):
    """A Docker SDK client, or None when there is no SDK or no engine."""
    sdk = docker_sdk()
    if sdk is None:
        return None
    try:
        return sdk.from_env(timeout=timeout)
    except Exception:  # noqa: BLE001 - no engine: callers work from the state file alone
        return None


def _overlapping_network(client, subnet: str) -> str | None:
    """The name and range of an engine network whose subnet overlaps ``subnet``, or None."""
    import ipaddress

    want = ipaddress.ip_network(subnet, strict=False)
    for net in client.networks.list():
        for cfg in ((net.attrs.get("IPAM") or {}).get("Config") or []):
            with contextlib.suppress(ValueError, TypeError):
                other = ipaddress.ip_network(cfg.get("Subnet"), strict=False)
                if other.version == want.version and other.overlaps(want):
                    return f"{net.name} ({other})"
    return None


# ---- up -----------------------------------------------------------------------------------------
def up(
    topology,
    name: str | None = None,
    *,
    command: Sequence[str] = (),
    gpus: int | None = None,
    image_tag: str = "latest",
    subnet: str | None = None,
    progress=None,
    **options: Any,
):
    """Bring a docker cluster up for ``topology`` (a path or a Topology); safe to call twice."""
    from ..topology import Topology, load_topology
    from .compose import DEFAULTS, render_compose
    from .netns_cluster import up_result

    topo = topology if isinstance(topology, Topology) else load_topology(topology, profile_may_be_missing=True)
    name = valid_name(name) if name else default_name(topo.name)
    say = progress or (lambda msg: None)
    # Before anything is written: no engine, no state file, nothing to take back.
    host = engine_or_fail()
    cl = client()
    t0 = time.perf_counter()
    st = ClusterState(name)
    with st.locked():
        if st.path.exists():
            if st.get("runtime") != "docker":
                raise InputError(f"cluster {name!r} exists with runtime {st.get('runtime')!r}; "
                                 f"run `nbox down {name}` first or pick another --name")
            from .netns_cluster import what_is_broken

            # Up means every container running and the netns side whole (namespaces bound, the agent alive).
            if st.get("phase") == "up" and _running(st, cl) and not what_is_broken(st):
                if st.get("topology_name") != topo.name:
                    raise InputError(f"cluster {name!r} is already up with topology {st.get('topology_name')!r}; "
                                     f"run `nbox down {name}` first or pick another --name")
                return up_result(st, already_up=True, notes=[f"cluster {name!r} is already up"])
            say(f"cluster {name!r} was left half made (phase {st.get('phase')!r}); removing it first")
            down(name, keep_lock=True)
            st = ClusterState(name)
        project_dir = st.dir / "compose"
        try:
            st.set(
                phase="creating", runtime="docker", topology=str(topo.source), topology_name=topo.name,
                created=time.time(), pid=os.getpid(), docker_host=host,
                docker={"driver": "sdk", "project": None, "dir": str(project_dir),
                        "networks": [], "containers": []},
            )
            rendered = render_compose(topo, project_dir, name=name, image_tag=image_tag, command=command, gpus=gpus,
                                      subnet=subnet or DEFAULTS["subnet"], **options)
            ctx = rendered.context
            st.data["docker"]["project"] = ctx["project_name"]
            st.set(plan={
                "subnet": ctx["network"]["subnet"],
                "hosts": [{"node": n["name"], "ns": None, "address": n["address"], "index": n["index"],
                           "service": n["service"], "role": n["role"]} for n in ctx["nodes"]],
                "links": [],
            })
            say(f"rendered {len(rendered.files)} files into {project_dir}")
            _sdk_up(cl, st, topo, rendered, subnet or DEFAULTS["subnet"], say)
            st.set(phase="up", up_seconds=time.perf_counter() - t0)
        except BaseException:
            with contextlib.suppress(Exception):
                down(name, keep_lock=True)
            raise
        finally:
            if not st.path.exists():
                st.remove_files()
    return up_result(st, seconds=time.perf_counter() - t0)


def _abs_volume(spec: str, base: Path) -> str:
    src, _, rest = spec.partition(":")
    if src.startswith("."):
        src = str((base / src).resolve())
    return f"{src}:{rest}"


def _ports(items: list[str]) -> dict[str, tuple[str, int] | int]:
    out: dict[str, Any] = {}
    for p in items:
        parts = str(p).split(":")
        if len(parts) == 3:
            out[f"{parts[2]}/tcp"] = (parts[0], int(parts[1]))
        elif len(parts) == 2:
            out[f"{parts[1]}/tcp"] = int(parts[0])
    return out


def service_kwargs(project: str, svc_name: str, svc: dict, net_name: str, base: Path) -> dict[str, Any]:
    """Keyword arguments of ``containers.run`` for one service of the rendered compose file."""
    def literal(v):
        # What compose itself would pass: its $$ is a literal $.
        return str(v).replace("$$", "$")

    kw: dict[str, Any] = {
        "image": svc["image"],
        "name": f"{project}-{svc_name}",
        "detach": True,
        "labels": {**svc.get("labels", {}), "com.docker.compose.project": project, "com.docker.compose.service": svc_name},
        "environment": {k: literal(v) for k, v in svc.get("environment", {}).items()},
        "network": net_name,
    }
    if "command" in svc:
        kw["command"] = [literal(a) for a in svc["command"]] if isinstance(svc["command"], list) else literal(svc["command"])
    if "hostname" in svc:
        kw["hostname"] = svc["hostname"]
    for key, arg in (("cap_add", "cap_add"), ("security_opt", "security_opt"), ("shm_size", "shm_size")):
        if key in svc:
            kw[arg] = svc[key]
    if svc.get("pid") == "host":
        kw["pid_mode"] = "host"
    if "ipc" in svc:
        kw["ipc_mode"] = svc["ipc"]
    if svc.get("volumes"):
        kw["volumes"] = [_abs_volume(v, base) for v in svc["volumes"]]
    if svc.get("ports"):
        kw["ports"] = _ports(svc["ports"])
    addr = ((svc.get("networks") or {}).get("cluster") or {}).get("ipv4_address")
    kw["networking_config"] = {net_name: {"Aliases": [svc_name], **({"IPAMConfig": {"IPv4Address": addr}} if addr else {})}}
    for dev in (((svc.get("deploy") or {}).get("resources") or {}).get("reservations") or {}).get("devices", []):
        kw.setdefault("device_requests", []).append(
            {"Driver": dev.get("driver", ""), "Count": int(dev.get("count", -1)), "Capabilities": [dev.get("capabilities", ["gpu"])]})
    return kw


# Services the runtime starts without their image: none. Grafana is rendered for `docker compose`
# users who can pull it; no Debian package carries it, so `nbox images build` cannot make it.
OPTIONAL_SERVICES = ("grafana",)


def _wait_address(cmd, address: str) -> list[str]:
    """``cmd`` (a list or a shell string) run once the node's address is on its lo: the netns plan adds it after start."""
    argv = cmd if isinstance(cmd, list) else ["sh", "-c", cmd]
    wait = f"until ip -4 -o addr show dev lo | grep -q 'inet {address}/'; do sleep 0.05; done; exec \"$@\""
    return ["sh", "-c", wait, "sh", *argv]


# The rendered project's services that `nbox up` starts: the nodes. The shaping agent is the netns
# runtime's, on the host (agent.py), and there is no engine network for Prometheus to scrape across.
def _node_services(ctx: dict) -> list[str]:
    return [n["service"] for n in ctx["nodes"]]


def _sdk_up(client, st: ClusterState, topo, rendered, subnet: str, say) -> None:
    """Start the node containers with no network, adopt their namespaces and give them the netns runtime's links."""
    import yaml

    from .netplan import plan_network
    from .netns_cluster import fault_point, up_netns

    spec = yaml.safe_load(rendered.compose_file.read_text())
    ctx = rendered.context
    project = st["docker"]["project"]
    wanted = set(_node_services(ctx))
    services = [svc for svc in _startable(client, {"services": {k: v for k, v in spec["services"].items() if k in wanted}}, say)]
    # Clashes are the user's to settle (exit 2), found before anything is made. The cluster has no
    # engine network now, but an overlap would make its addresses ambiguous to anyone reading both.
    clash = _overlapping_network(client, subnet)
    if clash:
        raise InputError(f"--subnet {subnet}: overlaps the docker network {clash}; "
                         f"pick another --subnet or remove that network")
    plan = plan_network(topo, st.name, subnet)
    addr = dict(plan.node_addr)
    node_of = {n["service"]: n["name"] for n in ctx["nodes"]}
    names = {svc_name: f"{project}-{svc_name}" for svc_name in services}
    from docker.errors import NotFound

    for cname in names.values():
        with contextlib.suppress(NotFound):
            other = client.containers.get(cname)
            raise InputError(f"--name {st.name}: a container named {cname!r} already exists "
                             f"(not this cluster's: {other.labels.get(LABEL, 'no nbox label')}); "
                             f"remove it or pick another --name")
    st.data["docker"]["containers"] = list(names.values())
    st.save()
    say(f"starting {len(names)} containers (no network: the netns plan gives them their links)")
    pids: dict[str, int] = {}

    def start(svc_name: str) -> None:
        svc = spec["services"][svc_name]
        kw = service_kwargs(project, svc_name, svc, "none", rendered.out_dir)
        node = node_of[svc_name]
        for key in ("network", "networking_config", "ports"):
            kw.pop(key, None)
        kw["network_mode"] = "none"
        kw["environment"]["NBOX_NODE_ADDR"] = addr[node]
        if (svc.get("labels") or {}).get("nbox.role") == "stub":
            # A peer's container holds its namespace; its wire-mode stub is started in it when a run
            # asks (cluster/stub.py, as on netns), so the stub the compose file names is not run here:
            # two stubs would contend for one port.
            kw.pop("command", None)
        kw["command"] = _wait_address(kw.get("command") or ["sleep", "infinity"], addr[node])
        c = client.containers.run(**kw)
        c.reload()
        pid = int(c.attrs["State"].get("Pid") or 0)
        if pid <= 0:  # it ended at once: nothing to adopt, and its log says why
            raise RunFailed(f"--runtime docker: container {c.name} exited at start ({c.status}); docker logs {c.name}")
        pids[svc_name] = pid

    half = len(services) // 2
    with ThreadPoolExecutor(max_workers=16, thread_name_prefix="nbox-docker-up") as pool:
        for i, batch in enumerate((services[:half], services[half:])):
            for f in [pool.submit(start, svc) for svc in batch]:
                f.result()
            if i == 0:
                fault_point("docker-containers")  # crash tests kill -9 `up` here, half the containers made
    adopt = {plan.node_ns[node_of[svc]]: pid for svc, pid in pids.items()}
    up_netns(st, topo, subnet, shape=True, rate_kind="tbf", agent=True, say=say, plan=plan, adopt=adopt)
    svc_of = {v: k for k, v in node_of.items()}
    for h in st.data["plan"]["hosts"]:
        h["service"] = svc_of[h["node"]]
        h["role"] = next(n["role"] for n in ctx["nodes"] if n["name"] == h["node"])
    st.save()
    # Node names resolve in the containers as in the netns runtime's namespaces (docker's DNS needs its network).
    lines = " ".join(f"'{a}\t{n}'" for n, a in addr.items())
    with ThreadPoolExecutor(max_workers=8, thread_name_prefix="nbox-docker-hosts") as pool:
        list(pool.map(lambda c: client.containers.get(c).exec_run(["sh", "-c", f"printf '%b\\n' {lines} >> /etc/hosts"]),
                      names.values()))


def _startable(client, spec: dict, say) -> list[str]:
    """The services whose image the engine has; a missing one is an InputError unless optional."""
    from docker.errors import ImageNotFound

    out = []
    for svc_name, svc in spec["services"].items():
        try:
            client.images.get(svc["image"])
        except ImageNotFound:
            if svc_name in OPTIONAL_SERVICES:
                say(f"not starting {svc_name}: no image {svc['image']} (not packaged here; see docs/guide/containers.md)")
                continue
            raise InputError(f"--runtime docker: the image {svc['image']} (service {svc_name}) is missing; "
                             f"build it with `nbox images build`") from None
        out.append(svc_name)
    return out


# ---- down and status -----------------------------------------------------------------------------
def down(name: str, keep_lock: bool = False) -> dict:
    """Remove every container and network of docker cluster ``name`` (recorded or labelled), then its state."""
    st = ClusterState.load(valid_name(name))
    d = st.get("docker") or {}
    removed = {"containers": 0, "networks": 0}
    client = _client()
    if client is not None:
        # Recorded names catch objects made before their labels; labels catch those made before a record was saved.
        found = {}
        with contextlib.suppress(Exception):
            for c in client.containers.list(all=True, filters={"label": f"{LABEL}={name}"}):
                found[c.name] = c
        for cname in d.get("containers", []):
            if cname not in found:
                with contextlib.suppress(Exception):
                    found[cname] = client.containers.get(cname)

        def remove(c) -> int:
            with contextlib.suppress(Exception):
                c.remove(force=True)
                return 1
            return 0

        with ThreadPoolExecutor(max_workers=8, thread_name_prefix="nbox-docker-down") as pool:
            removed["containers"] = sum(pool.map(remove, found.values()))
        nets = {}
        with contextlib.suppress(Exception):
            for n in client.networks.list(filters={"label": f"{LABEL}={name}"}):
                nets[n.name] = n
        for nname in d.get("networks", []):
            if nname not in nets:
                with contextlib.suppress(Exception):
                    nets[nname] = client.networks.get(nname)
        for n in nets.values():
            with contextlib.suppress(Exception):
                n.remove()
                removed["networks"] += 1
    # Then what the netns plan made in the containers' namespaces: the host's agent and relays,
    # and the namespaces' names (unbound; each namespace went with its container).
    from .netns_cluster import down_network

    net = down_network(st)
    if d.get("dir"):
        shutil.rmtree(d["dir"], ignore_errors=True)
    st.remove_files(keep_lock=keep_lock)
    return {"name": name, **removed, **net}


def exec_in(name: str, host: dict, cmd: list[str], env: dict | None = None, capture_output: bool = False,
            text: bool = False, timeout: float | None = None, **_ignored) -> subprocess.CompletedProcess:
    """Run ``cmd`` inside the container of ``host`` (a plan entry) and wait: a CompletedProcess, as subprocess.run."""
    from docker.errors import APIError, NotFound

    st = ClusterState.load(valid_name(name))
    cname = f"{(st.get('docker') or {}).get('project')}-{host['service']}"
    api = client(timeout=int(timeout) if timeout else 120).api
    try:
        ex = api.exec_create(cname, list(cmd), environment={k: str(v) for k, v in (env or {}).items()})
        chunks = api.exec_start(ex["Id"], stream=True, demux=True)
        out, err = bytearray(), bytearray()
        for o, e in chunks:
            if capture_output:
                out += o or b""
                err += e or b""
            else:
                for data, stream in ((o, sys.stdout), (e, sys.stderr)):
                    if data:
                        stream.flush()
                        stream.buffer.write(data)
                        stream.buffer.flush()
        code = api.exec_inspect(ex["Id"])["ExitCode"]
    except NotFound:
        raise InputError(f"exec: node {host['node']}'s container {cname!r} does not exist (nbox status; nbox up)") from None
    except APIError as exc:
        raise RunFailed(f"exec: the engine refused to run {cmd[0]!r} in {cname}: {exc.explanation or exc}") from None
    so, se = (bytes(out), bytes(err)) if capture_output else (None, None)
    if text and capture_output:
        so, se = so.decode(errors="replace"), se.decode(errors="replace")
    return subprocess.CompletedProcess(list(cmd), code if code is not None else 1, so, se)


def _containers(st: ClusterState, client) -> dict[str, str] | None:
    """Container name -> state for the cluster's containers; None when nothing can ask the engine."""
    if client is not None:
        out = {}
        with contextlib.suppress(Exception):
            for c in client.containers.list(all=True, filters={"label": f"{LABEL}={st.name}"}):
                out[c.name] = c.status
        return out
    return None


def _running(st: ClusterState, client) -> bool:
    states = _containers(st, client or _client(10)) or {}
    want = (st.get("docker") or {}).get("containers") or list(states)
    return bool(want) and all(states.get(c) == "running" for c in want)


def status(name: str, settle: float = 0.0) -> dict:
    """Summary of docker cluster ``name`` (the keys of ``runtime.status`` rows, plus containers and project)."""
    st = ClusterState.load(valid_name(name))
    d = st.get("docker") or {}
    states = _containers(st, _client(10))
    recorded = d.get("containers") or sorted(states or {})
    running = sum(1 for c in recorded if (states or {}).get(c) == "running")
    from .namespace import Namespace
    from .netns_cluster import health as netns_health
    from .netns_cluster import process_alive

    plan = st.get("plan") or {}
    present = sum(1 for x in st["namespaces"] if Namespace(x["name"]).exists())
    agents = [p for p in st["processes"] if p.get("role") == "agent"]
    health = netns_health(st, settle) if st.get("phase") == "up" else {"healthy": False, "problem": f"phase {st.get('phase')!r}"}
    if health["healthy"] and (states is None or running != len(recorded)):
        health = {"healthy": False, "problem": f"{len(recorded) - running} of {len(recorded)} containers are not running; "
                                               f"`nbox up {st.get('topology')} --runtime docker --name {name}` rebuilds it"}
    return {
        "name": name,
        "runtime": "docker",
        "phase": st.get("phase"),
        "topology": st.get("topology"),
        "project": d.get("project"),
        "nodes": len((st.get("plan") or {}).get("hosts", [])),
        "links": len(plan.get("links", [])),
        "namespaces": f"{present}/{len(st['namespaces'])}",
        "containers": f"{running}/{len(recorded)}" if states is not None else f"?/{len(recorded)} (no engine)",
        "agent": (st.get("agent") or {}).get("url") if any(process_alive(p) for p in agents) else None,
        **health,
    }


# ---- the agent inside the cluster -------------------------------------------------------------------
def find_node_pids(cluster: str, nodes: list[str], proc: str = "/proc") -> dict[str, int]:
    """Per node, the lowest pid whose environment has NBOX_CLUSTER=<cluster> and NBOX_NODE=<node>."""
    want = {f"NBOX_NODE={n}".encode(): n for n in nodes}
    tag = f"NBOX_CLUSTER={cluster}".encode()
    out: dict[str, int] = {}
    for entry in sorted((e for e in os.listdir(proc) if e.isdigit()), key=int):
        if int(entry) == os.getpid():
            continue
        try:
            env = Path(proc, entry, "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if tag not in env:
            continue
        for var in env:
            node = want.get(var)
            if node is not None and node not in out:
                out[node] = int(entry)
    return out


class DockerAgent:
    """The docker cluster's shaping agent: each node's eth0 egress, applied inside its container."""

    def __init__(self, config: dict, proc: str = "/proc"):
        from .shaping import LinkShape

        self.cluster = config["cluster"]
        self.nodes = {n["name"]: n for n in config["nodes"]}
        self.shapes = {n["name"]: LinkShape(**n["shape"]) for n in config["nodes"]}
        self.proc = proc
        self.pids: dict[str, int] = {}
        self.pending: dict[str, int] = {}  # found, being shaped
        self.netem = False
        self.errors: dict[str, str] = {}
        self.port: int | None = None
        self.ready = threading.Event()  # set once the API listens (port known)
        self.lock = threading.RLock()
        # pyroute2 sockets belong to the thread (and namespace) that made them: one netlink thread.
        self.nl = ThreadPoolExecutor(max_workers=1, thread_name_prefix="nbox-netlink")

    def _ns(self, node: str):
        from .namespace import Namespace

        ns = Namespace(f"docker-{node}")
        ns.path = f"{self.proc}/{self.pids.get(node) or self.pending[node]}/ns/net"
        return ns

    def _apply(self, node: str, change: bool) -> None:
        from .shaping import apply_rate, delete_root

        ipr = self._ns(node).iproute()
        try:
            idx = ipr.link_lookup(ifname="eth0")[0]
            if not change:
                delete_root(ipr, idx)
            try:
                apply_rate(ipr, idx, self.shapes[node], "tbf", change=change, netem=self.netem)
            except Exception:  # noqa: BLE001 - nothing to change yet, or tbf to become htb: install afresh
                delete_root(ipr, idx)
                apply_rate(ipr, idx, self.shapes[node], "tbf", change=False, netem=self.netem)
        finally:
            ipr.close()
        # Keep each flow in order on a slow link (steering.py); the bridge side is the engine's.
        rate = self.shapes[node].rate
        steer_flows(steering([([(self._ns(node).path, "eth0")], rate, rate)]))

    def discover(self) -> list[str]:
        """Find nodes not yet shaped (or restarted) and shape them; returns the nodes shaped now."""
        alive = {n: p for n, p in self.pids.items() if os.path.exists(f"{self.proc}/{p}")}
        missing = [n for n in self.nodes if n not in alive]
        if not missing:
            return []
        found = find_node_pids(self.cluster, missing, self.proc)
        done = []
        with self.lock:
            # A node enters `pids` (what /health lists, and what `up` waits for) once it is shaped.
            self.pids = dict(alive)
            for node, pid in found.items():
                self.pending[node] = pid
                try:
                    self.nl.submit(self._apply, node, False).result()
                    self.pids[node] = pid
                    self.errors.pop(node, None)
                    done.append(node)
                except Exception as exc:  # noqa: BLE001 - report per node, keep serving the rest
                    self.errors[node] = f"{type(exc).__name__}: {exc}"
                finally:
                    self.pending.pop(node, None)
        return done

    def set_node(self, node: str, changes: dict[str, float]) -> dict:
        """Change a node's egress shape live."""
        from dataclasses import replace

        from .agent import ShapeRefused

        if node not in self.nodes:
            raise InputError(f"no node named {node!r} (GET /links lists them)")
        with self.lock:
            old = self.shapes[node]
            # The kernel first; the new shape stays only if it took (as the netns agent does).
            self.shapes[node] = replace(old, **changes)
            if node in self.pids:
                try:
                    self.nl.submit(self._apply, node, True).result()
                except Exception as exc:  # noqa: BLE001
                    self.shapes[node] = old
                    with contextlib.suppress(Exception):
                        self.nl.submit(self._apply, node, True).result()
                    raise ShapeRefused(f"node {node}: the kernel refused the change ({type(exc).__name__}: "
                                       f"{str(exc)[:200]}); the link keeps its shape") from None
        return self.view(node)

    def counters(self) -> dict[str, dict[str, int]]:
        """Per node: eth0 tx bytes, packets and drops (qdisc and device), read now."""
        return self.nl.submit(self._counters).result()

    def _counters(self) -> dict[str, dict[str, int]]:
        out = {}
        for node in list(self.pids):
            try:
                ipr = self._ns(node).iproute()
            except OSError:
                continue
            try:
                idx = ipr.link_lookup(ifname="eth0")[0]
                s = ipr.get_links(idx)[0].get_attr("IFLA_STATS64") or {}
                qdrops = 0
                for q in ipr.get_qdiscs(idx):
                    s2 = q.get_attr("TCA_STATS2")
                    qs = s2.get_attr("TCA_STATS_QUEUE") if s2 is not None else None
                    qdrops += qs.get("drops", 0) if qs else 0
                out[node] = {"bytes": int(s.get("tx_bytes", 0)), "packets": int(s.get("tx_packets", 0)),
                             "drops": int(qdrops + s.get("tx_dropped", 0))}
            except Exception:  # noqa: BLE001 - a container that just went away
                continue
            finally:
                ipr.close()
        return out

    def view(self, node: str, counters: dict | None = None) -> dict:
        """A node's link as the API shows it."""
        from .shaping import mechanisms

        s = self.shapes[node]
        m = mechanisms([s], self.netem)
        if not self.netem:
            # Without netem a docker node has no delay relay: delay, jitter and loss stay unapplied.
            m = {**m, **{k: "none (host kernel lacks netem)" for k in ("delay", "loss") if m[k] != "none"}}
        return {"name": node, "link": f"{node}:eth0", "address": self.nodes[node]["address"], "pid": self.pids.get(node),
                "shape": s.as_dict(), "mechanisms": m, "error": self.errors.get(node),
                **({"counters": (counters or {}).get(node)} if counters is not None else {})}

    def metrics_text(self) -> bytes:
        """Prometheus exposition of every node link (the netns agent's metric names)."""
        from prometheus_client import CollectorRegistry, generate_latest
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        agent = self

        class Collector:
            def collect(self):
                labels = ["cluster", "link", "direction"]
                fam = {
                    "bytes": CounterMetricFamily("nbox_link_transmit_bytes", "Bytes sent into the link (sending end)", labels=labels),
                    "packets": CounterMetricFamily("nbox_link_transmit_packets", "Packets sent into the link", labels=labels),
                    "drops": CounterMetricFamily("nbox_link_drops", "Packets dropped by the shaping queue or the device", labels=labels),
                }
                gauges = {k: GaugeMetricFamily(n, h, labels=labels) for k, n, h in (
                    ("rate", "nbox_link_rate_bytes_per_second", "Configured rate (0: unshaped)"),
                    ("delay", "nbox_link_delay_seconds", "Configured one-way delay"),
                    ("jitter", "nbox_link_jitter_seconds", "Configured jitter"),
                    ("loss", "nbox_link_loss_ratio", "Configured loss"))}
                counters = agent.counters()
                for node in agent.nodes:
                    lv = [agent.cluster, f"{node}:eth0", "ab"]
                    for k, f in fam.items():
                        if node in counters:
                            f.add_metric(lv, counters[node][k])
                    for k, g in gauges.items():
                        g.add_metric(lv, getattr(agent.shapes[node], k))
                yield from fam.values()
                yield from gauges.values()

        registry = CollectorRegistry()
        registry.register(Collector())
        return generate_latest(registry)

    def serve(self, port: int, host: str = "0.0.0.0", stop: threading.Event | None = None) -> None:
        """Shape, then serve the API until ``stop`` is set (or forever)."""
        from urllib.parse import unquote

        from ..units import quoted
        from .agent import JsonRequestHandler, _Server

        with contextlib.suppress(Exception):
            from .shaping import has_netem

            self.netem = has_netem()
        stop = stop or threading.Event()
        agent = self

        class Handler(JsonRequestHandler):
            """GET /health, /links, /links/<node>, /metrics; POST /links/<node>."""

            def do_GET(self):
                path = unquote(self.path.split("?")[0]).rstrip("/")
                if path == "/metrics":
                    self._send(200, agent.metrics_text(), "text/plain; version=0.0.4")
                elif path == "/health":
                    self._send(200, {"cluster": agent.cluster, "netem": agent.netem, "nodes": agent.pids, "errors": agent.errors})
                elif path == "/links":
                    c = agent.counters()
                    self._send(200, [agent.view(n, c) for n in agent.nodes])
                elif path.startswith("/links/") and path[len("/links/"):] in agent.nodes:
                    self._send(200, agent.view(path[len("/links/"):], agent.counters()))
                else:
                    self._send(404, {"error": f"no such resource {quoted(path)}"})

            def do_POST(self):
                path = unquote(self.path.split("?")[0]).rstrip("/")
                node = path[len("/links/"):] if path.startswith("/links/") else None
                if node not in agent.nodes:
                    self.close_connection = True  # the body is left unread
                    self._send(404, {"error": f"no such resource {quoted(path)}"})
                    return
                # The netns agent's strict reading (agent.py): 400/408/413 naming the problem.
                self.answer_shape(lambda: node, lambda n, req: agent.set_node(n, req.changes()))

        httpd = _Server((host, port), Handler)
        self.port = httpd.server_address[1]
        self.ready.set()
        threading.Thread(target=httpd.serve_forever, daemon=True, name="nbox-docker-agent-http").start()
        try:
            # Nodes start in any order and may restart: keep looking for the ones not shaped.
            # Nodes start in any order: look often until all are shaped (up waits for that), then every 2 s.
            while not stop.wait(0.1 if len(self.pids) < len(self.nodes) else 2.0):
                self.discover()
        finally:
            httpd.shutdown()
            httpd.server_close()


def _agent_main(argv: list[str]) -> int:
    import signal

    ap = argparse.ArgumentParser(prog="nbox-docker-agent", description="The shaping agent inside a docker cluster.")
    ap.add_argument("--config", required=True, help="cluster.json rendered by nbox compose")
    ap.add_argument("--port", type=int, default=9465)
    ap.add_argument("--host", default="0.0.0.0")
    args = ap.parse_args(argv)
    agent = DockerAgent(json.loads(Path(args.config).read_text()))
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    agent.serve(args.port, args.host, stop)
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m neuronabox.cluster.docker_runtime agent ...`` (the container side)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] != "agent":
        print("usage: python -m neuronabox.cluster.docker_runtime agent --config FILE [--port N]", file=sys.stderr)
        return 2
    return _agent_main(argv[1:])


if __name__ == "__main__":
    raise SystemExit(main())
