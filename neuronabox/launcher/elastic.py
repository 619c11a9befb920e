"""Several real ranks: ``nbox run --nproc-per-node K [--nnodes N ...]`` through torch's own elastic launcher.

The parent side (``plan_launch``, ``run_elastic``) starts torch's ``LocalElasticAgent``
(``torch.distributed.launcher.api``) with torch's rendezvous (``c10d`` or ``static``), exactly
as ``torchrun`` would: each worker gets torchrun's environment, in which RANK is the index
among the real ranks (0..N*K-1) and MASTER_ADDR/MASTER_PORT name the agent's TCPStore.

The child side (``worker_env``, run by the autostart ``sitecustomize`` before the user's
script) turns that into the environment contract of the nbox backend:

- RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, ...: the emulated world's
  values for this process (``prepare_env``), NBOX_REAL_RANK = its world rank;
- NBOX_REAL_RANKS: the run's real world ranks, sorted, comma-separated; real index i is
  world rank ``NBOX_REAL_RANKS[i]``;
- NBOX_REAL_STORE = the agent store's MASTER_ADDR:MASTER_PORT, NBOX_REAL_STORE_PREFIX = run id
  and restart count (a restart gets fresh keys); NBOX_REAL_TIMEOUT when given;
- torchrun's own values stay readable as NBOX_LAUNCH_RANK, NBOX_LAUNCH_LOCAL_RANK,
  NBOX_LAUNCH_WORLD_SIZE, NBOX_LAUNCH_GROUP_RANK.

CPU workers are pinned to one core each (round-robin over the cores ``nbox run`` may use);
GPU workers keep torchrun's LOCAL_RANK -> CUDA device rule, which is why a GPU node's real
ranks must be its first K local ranks.
"""

from __future__ import annotations

import ipaddress
import json
import os
import shutil
import signal
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from ..emu.environ import ENV_ELASTIC, ENV_REAL_RANKS, ENV_REAL_STORE, ENV_REAL_STORE_PREFIX, ENV_REAL_TIMEOUT
from ..errors import InputError
from ..topology import Topology

__all__ = [
    "LaunchOptions",
    "LaunchPlan",
    "ElasticResult",
    "choose_real_ranks",
    "plan_launch",
    "run_elastic",
    "worker_env",
    "apply_worker_env",
    "ENV_REAL_RANKS",
    "ENV_REAL_STORE",
    "ENV_REAL_STORE_PREFIX",
    "ENV_REAL_TIMEOUT",
]

ENV_RECORD_DIR = "NBOX_RECORD_DIR"
ENV_CPU_CORES = "NBOX_CPU_CORES"
_LAUNCH_KEYS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "GROUP_RANK", "LOCAL_WORLD_SIZE")
BACKENDS = ("c10d", "static")


@dataclass
class LaunchOptions:
    """torchrun's arguments as ``nbox run`` takes them."""

    nproc_per_node: int = 1
    nnodes: str = "1"
    node_rank: int | None = None
    rdzv_endpoint: str | None = None
    rdzv_backend: str | None = None
    rdzv_id: str | None = None
    max_restarts: int = 0
    monitor_interval: float = 0.1

    def elastic(self) -> bool:
        """Whether these flags ask for the elastic launcher (anything beyond one local real rank)."""
        return self.nproc_per_node != 1 or self.nnodes != "1" or bool(self.rdzv_endpoint) or self.node_rank is not None


@dataclass
class LaunchPlan:
    """What ``run_elastic`` starts: the real ranks and torch's launch configuration."""

    real_ranks: list[int]
    nnodes: int
    nproc_per_node: int
    rdzv_backend: str
    rdzv_endpoint: str
    run_id: str
    rdzv_configs: dict[str, Any] = field(default_factory=dict)
    local_addr: str | None = None
    cpu_cores: list[int] | None = None
    max_restarts: int = 0
    monitor_interval: float = 0.1


@dataclass
class ElasticResult:
    """How the workers ended: exit code, one record per real world rank that wrote one, failures by world rank."""

    returncode: int
    records: dict[int, dict]
    failures: dict[int, str]
    real_ranks: list[int]
    error: str | None = None
    stopped_by: str | None = None  # SIGINT or SIGTERM when nbox itself was stopped while the workers ran


def _parse_nnodes(value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        raise InputError(
            f"--nnodes: expected a whole number of real nodes, got {value!r} (elastic MIN:MAX ranges would change "
            "which ranks are real while the run goes)"
        ) from None
    if n < 1:
        raise InputError(f"--nnodes: must be 1 or more, got {n}")
    return n


def choose_real_ranks(topology: Topology, nproc_per_node: int, nnodes: int) -> list[int]:
    """The real world ranks: ``emulation.real_ranks`` if it lists N*K of them, else the first K of nodes 0..N-1."""
    if nproc_per_node < 1:
        raise InputError(f"--nproc-per-node: must be 1 or more, got {nproc_per_node}")
    listed = sorted(topology.emulation.real_ranks)
    if len(listed) == nnodes * nproc_per_node:
        return listed
    if nnodes > len(topology.nodes):
        raise InputError(
            f"--nnodes: {nnodes} real nodes but topology {topology.name!r} has {len(topology.nodes)} nodes"
        )
    ranks: list[int] = []
    for node in topology.nodes[:nnodes]:
        if nproc_per_node > node.ranks:
            raise InputError(
                f"--nproc-per-node: {nproc_per_node} real ranks per node but node {node.name} of topology "
                f"{topology.name!r} has {node.ranks} ranks"
            )
        ranks.extend(node.rank_range[:nproc_per_node])
    return ranks


def _endpoint_is_here(host: str) -> bool:
    """Whether ``host`` is an address of an interface of this (network namespace's) machine."""
    import psutil

    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False  # a name: torch's own hostname match decides
    return any(a.address == host for addrs in psutil.net_if_addrs().values() for a in addrs)


_CLONE_NEWUTS = 0x04000000


def _take_node_hostname(address: str) -> None:
    """Inside a cluster node, give this thread (and the workers it starts) a hostname that is the node's address.

    A real machine's hostname resolves to its own address, and gloo binds what the hostname
    resolves to. A network namespace keeps the machine's hostname, which names an address the
    node cannot use; ``GLOO_SOCKET_IFNAME`` would bind the NIC's link address, which the delay
    relay does not know (neuronabox/fidelity/validate.py measured it). A private UTS namespace
    named after the node address is what each machine has for real. Needs root; without it
    (the local runtime: loopback addresses, one machine) nothing changes.
    """
    import ctypes
    import socket

    try:
        if socket.gethostbyname(socket.gethostname()) == address:
            return
    except OSError:
        pass
    if os.geteuid() != 0 or not _endpoint_is_here(address):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    name = address.encode()
    if libc.unshare(_CLONE_NEWUTS) != 0 or libc.sethostname(name, len(name)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"nbox run: cannot name this node {address} (unshare/sethostname): {os.strerror(err)}")


def plan_launch(topology: Topology, opts: LaunchOptions, node_addr: str | None = None) -> LaunchPlan:
    """Check torchrun's flags against the topology and settle the real ranks and the rendezvous."""
    nnodes = _parse_nnodes(opts.nnodes)
    k = opts.nproc_per_node
    real = choose_real_ranks(topology, k, nnodes)
    if opts.max_restarts < 0:
        raise InputError(f"--max-restarts: must be 0 or more, got {opts.max_restarts}")
    backend = opts.rdzv_backend or "static"  # torchrun's default
    if backend not in BACKENDS:
        raise InputError(f"--rdzv-backend: expected one of {', '.join(BACKENDS)}, got {backend!r}")
    if opts.node_rank is not None and not 0 <= opts.node_rank < nnodes:
        raise InputError(f"--node-rank: must be in 0-{nnodes - 1} (--nnodes {nnodes}), got {opts.node_rank}")
    configs: dict[str, Any] = {}
    if nnodes == 1 and not opts.rdzv_endpoint:
        # torchrun --standalone: a c10d rendezvous on a free port of this machine (of the
        # cluster node's address when there is one: a node's namespace may have no loopback).
        backend, endpoint = "c10d", f"{node_addr or '127.0.0.1'}:0"
        configs["is_host"] = True
        run_id = opts.rdzv_id or f"nbox-{uuid.uuid4().hex[:12]}"
    else:
        if not opts.rdzv_endpoint:
            raise InputError(f"--rdzv-endpoint: --nnodes {nnodes} needs HOST:PORT of the rendezvous (node 0's address)")
        endpoint = opts.rdzv_endpoint
        host, sep, port = endpoint.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise InputError(f"--rdzv-endpoint: expected HOST:PORT, got {endpoint!r}")
        run_id = opts.rdzv_id or "none"  # torchrun's default: every node must agree on it
        if backend == "static":
            if opts.node_rank is None:
                raise InputError("--node-rank: the static rendezvous needs this node's rank (0 hosts the store)")
            configs["rank"] = opts.node_rank
        elif _endpoint_is_here(host):
            # torch guesses "am I the host?" from the hostname, which in a network namespace (or a
            # container) names the wrong machine; an endpoint that is one of our own addresses is ours.
            configs["is_host"] = True
    dev = {topology.node_of(r).device.lower() for r in real}
    cores = None
    if dev == {"cpu"}:
        cores = sorted(os.sched_getaffinity(0))
    else:
        for i, r in enumerate(real):
            if topology.local_rank(r) != i % k:
                raise InputError(
                    f"emulation.real_ranks: on GPU nodes the real ranks must be the first {k} local ranks of their "
                    f"nodes (torchrun maps LOCAL_RANK to the CUDA device); rank {r} is local rank "
                    f"{topology.local_rank(r)}"
                )
    return LaunchPlan(
        real_ranks=real, nnodes=nnodes, nproc_per_node=k, rdzv_backend=backend, rdzv_endpoint=endpoint, run_id=run_id,
        rdzv_configs=configs, local_addr=node_addr, cpu_cores=cores, max_restarts=opts.max_restarts,
        monitor_interval=opts.monitor_interval,
    )


def _check_command(command: Sequence[str]) -> None:
    exe = command[0]
    if os.sep in exe:
        if not os.path.exists(exe):
            raise InputError(f"nbox run: command not found: {exe!r}")
        if not os.access(exe, os.X_OK):
            raise InputError(f"nbox run: command not executable: {exe!r}")
    elif shutil.which(exe) is None:
        raise InputError(f"nbox run: command not found: {exe!r}")


def run_elastic(plan: LaunchPlan, command: Sequence[str], env: Mapping[str, str], workdir: Path) -> ElasticResult:
    """Start the workers with torch's elastic agent (``env``: what each inherits); wait; collect records, failures."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    _check_command(command)
    record_dir = workdir / "records"
    record_dir.mkdir(parents=True, exist_ok=True)
    worker = dict(env)
    worker[ENV_ELASTIC] = "1"
    worker[ENV_REAL_RANKS] = ",".join(map(str, plan.real_ranks))
    worker[ENV_RECORD_DIR] = str(record_dir)
    worker.pop("NBOX_RECORD", None)
    if plan.cpu_cores:
        worker[ENV_CPU_CORES] = ",".join(map(str, plan.cpu_cores))
        if "OMP_NUM_THREADS" not in worker and plan.nproc_per_node > 1:
            worker["OMP_NUM_THREADS"] = "1"  # what torchrun does; each worker has one core anyway
    if plan.local_addr and "GLOO_SOCKET_IFNAME" not in worker:
        _take_node_hostname(plan.local_addr)
    config = LaunchConfig(
        min_nodes=plan.nnodes,
        max_nodes=plan.nnodes,
        nproc_per_node=plan.nproc_per_node,
        run_id=plan.run_id,
        role="nbox",
        rdzv_endpoint=plan.rdzv_endpoint,
        rdzv_backend=plan.rdzv_backend,
        rdzv_configs=dict(plan.rdzv_configs),
        max_restarts=plan.max_restarts,
        monitor_interval=plan.monitor_interval,
        start_method="spawn",
        local_addr=plan.local_addr,
        logs_specs=DefaultLogsSpecs(log_dir=str(workdir / "torchelastic")),
    )
    failures: dict[int, str] = {}
    error = stopped_by = None
    saved = dict(os.environ)
    # The agent's workers inherit this process's environment (torch copies os.environ).
    os.environ.clear()
    os.environ.update(worker)
    try:
        elastic_launch(config, command[0])(*command[1:])
        rc = 0
    except ChildFailedError as exc:
        from .exits import describe_exit

        rc = 1
        ordered = sorted(exc.failures.items(), key=lambda kv: kv[1].timestamp)
        for n, (index, f) in enumerate(ordered):
            world = plan.real_ranks[index] if 0 <= index < len(plan.real_ranks) else index
            first = " (first failure)" if n == 0 and len(ordered) > 1 else ""
            failures[world] = f"real rank {world} (launch rank {index}) {describe_exit(f.exitcode)}{first}"
    except SignalException as exc:  # Ctrl-C or a TERM to nbox run: torch's agent has stopped the workers
        rc, stopped_by = 1, signal.Signals(exc.sigval).name
    except RendezvousError as exc:
        rc = 1
        error = f"the rendezvous at {plan.rdzv_endpoint} ({plan.rdzv_backend}) failed: {type(exc).__name__}: {exc}"
    finally:
        os.environ.clear()
        os.environ.update(saved)
    records = {}
    for p in sorted(record_dir.glob("rank-*.json")):
        rank = int(p.stem.split("-", 1)[1])
        try:
            records[rank] = json.loads(p.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
    return ElasticResult(rc, records, failures, plan.real_ranks, error, stopped_by)


# ---- the child side -------------------------------------------------------------------------------
def worker_env(environ: Mapping[str, str], topology: Topology | None = None) -> dict[str, str]:
    """The nbox contract for a worker that torch's agent started: the variables to set (see the module doc)."""
    from ..emu.environ import ENV_REAL_RANK, ENV_TOPOLOGY, prepare_env

    if topology is None:
        from ..topology import load_topology

        topology = load_topology(environ[ENV_TOPOLOGY])
    reals = [int(r) for r in environ[ENV_REAL_RANKS].split(",") if r]
    index, n = int(environ["RANK"]), int(environ["WORLD_SIZE"])
    if n != len(reals) or not 0 <= index < n:
        raise RuntimeError(
            f"nbox: the launcher started {n} workers (this one is rank {index}) but the run has {len(reals)} real "
            f"ranks ({environ[ENV_REAL_RANKS]}): every node must use the same --nnodes and --nproc-per-node"
        )
    world_rank = reals[index]
    run_id = environ.get("TORCHELASTIC_RUN_ID") or "none"
    restart = environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    out = prepare_env(topology, world_rank, run_id=run_id)
    out["TORCHELASTIC_RESTART_COUNT"] = restart
    out["TORCHELASTIC_MAX_RESTARTS"] = environ.get("TORCHELASTIC_MAX_RESTARTS", "0")
    out[ENV_REAL_RANK] = str(world_rank)
    out[ENV_REAL_STORE] = f"{environ['MASTER_ADDR']}:{environ['MASTER_PORT']}"
    out[ENV_REAL_STORE_PREFIX] = f"nbox/{run_id}/{restart}"
    for key in _LAUNCH_KEYS:
        if key in environ:
            out[f"NBOX_LAUNCH_{key}"] = environ[key]
    if environ.get(ENV_RECORD_DIR):
        out["NBOX_RECORD"] = str(Path(environ[ENV_RECORD_DIR]) / f"rank-{world_rank}.json")
    local = int(environ.get("LOCAL_RANK", "0"))
    addr = environ.get("NBOX_METRICS_ADDR")
    if addr:
        host, _, port = addr.rpartition(":")
        if port.isdigit() and int(port) != 0:
            out["NBOX_METRICS_ADDR"] = f"{host}:{int(port) + local}"  # one exporter per real rank on this machine
    out[ENV_ELASTIC] = "done"
    return out


def apply_worker_env() -> None:
    """In a worker of ``run_elastic``: rewrite ``os.environ`` to the nbox contract and pin a CPU worker to its core."""
    if os.environ.get(ENV_ELASTIC) != "1":
        return
    launch_local = int(os.environ.get("LOCAL_RANK", "0"))
    launch_index = int(os.environ.get("RANK", "0"))
    os.environ.update(worker_env(os.environ))
    if launch_index != 0:
        os.environ.pop("NBOX_PROGRESS_FILE", None)  # the live progress line follows the first real rank
    cores = [int(c) for c in os.environ.get(ENV_CPU_CORES, "").split(",") if c]
    if cores:
        os.sched_setaffinity(0, {cores[launch_local % len(cores)]})
