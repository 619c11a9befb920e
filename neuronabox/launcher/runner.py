"""The parent side of ``nbox run``: start the user's command as the real rank(s), wait, collect their records.

One real rank (``run_command``): the command runs unmodified in a child process whose
environment is what torchrun would give the real rank, plus ``NBOX_TOPOLOGY`` (the effective
topology, what-if flags merged) and a ``PYTHONPATH`` entry whose ``sitecustomize`` installs the
nbox backend before user code runs. Several (``run_real_ranks``, ``--nproc-per-node``/``--nnodes``):
torch's elastic agent starts the workers with the same environment, and each worker's
``sitecustomize`` turns torchrun's values into the emulated world's (``elastic.py``).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from ..emu.environ import ENV_MODEL, ENV_REAL_RANK, ENV_TOPOLOGY, child_pythonpath, prepare_env
from ..emu.spawn import error_file
from ..errors import InputError
from ..runfiles import owned_tempdir
from ..topology import Topology
from ..topology.resolve import dump_yaml
from .exits import describe_exit
from .guard import ENV_PARENT, die_with_parent

__all__ = ["RunResult", "run_command", "run_real_ranks", "AUTOSTART_DIR"]

AUTOSTART_DIR = Path(__file__).resolve().parent / "autostart"


@dataclass
class RunResult:
    """How the command ended and what the real ranks recorded.

    ``record`` is the (first) real rank's record, None if it never used torch.distributed;
    ``records`` holds every real rank's by world rank; ``failures`` says, by world rank, how each
    failed real rank ended (one line each, the first failure first).
    """

    returncode: int
    record: dict[str, Any] | None
    records: dict[int, dict[str, Any]] = field(default_factory=dict)
    failures: dict[int, str] = field(default_factory=dict)
    error: str | None = None  # a launcher failure that no rank owns (the rendezvous)
    stopped_by: str | None = None  # SIGINT or SIGTERM when nbox itself was stopped while the command ran


def child_env(topology_file: Path, topology: Topology, real_rank: int, record: Path, model: str | None) -> dict[str, str]:
    """The real rank's environment: torchrun's contract plus what the nbox backend needs."""
    env = dict(os.environ)
    env.update(prepare_env(topology, real_rank))
    env[ENV_REAL_RANK] = str(real_rank)
    env["NBOX_RECORD"] = str(record)
    _add_backend(env, topology_file, model)
    return env


def _add_backend(env: dict[str, str], topology_file: Path, model: str | None) -> None:
    # The child finds the emulated cluster through these and installs the nbox backend from the
    # autostart sitecustomize at the head of its PYTHONPATH.
    env[ENV_TOPOLOGY] = str(topology_file)
    if model:
        env[ENV_MODEL] = model
    env["PYTHONPATH"] = child_pythonpath(AUTOSTART_DIR)


def _write_topology(folder: str, topology: Topology) -> Path:
    """The effective topology (what-ifs applied) as the YAML file the child reads."""
    path = Path(folder) / "topology.yaml"
    path.write_text(dump_yaml(topology), encoding="utf-8")
    return path


def _require_command(command: Sequence[str]) -> None:
    if not command:
        raise InputError("nbox run: no command to run (usage: nbox run TOPOLOGY [OPTIONS] -- python train.py ARGS)")
    script = python_script(command)
    if script is not None and not os.path.isfile(script):
        # Python would say so itself, but only after the run started, and then nbox would add that
        # nothing was emulated and that the command failed: three lines for one typo.
        raise InputError(f"nbox run: no such script: {script!r} (from {os.getcwd()})")


# Interpreter options that take the next argument as their value (``python -W ignore x.py``).
_PY_VALUE_OPTIONS = {"-W", "-X", "--check-hash-based-pycs"}


def python_script(command: Sequence[str]) -> str | None:
    """The script a ``python ... SCRIPT args`` command runs; None for ``-c``, ``-m``, stdin or another program."""
    if not re.fullmatch(r"python[0-9.]*", os.path.basename(command[0])):
        return None
    args = iter(command[1:])
    for arg in args:
        if arg in ("-c", "-m", "-") or arg.startswith(("-c", "-m")) and not arg.startswith("--"):
            return None
        if arg in _PY_VALUE_OPTIONS:
            next(args, None)
        elif not arg.startswith("-"):
            return arg
    return None


def run_command(
    topology: Topology,
    command: Sequence[str],
    real_rank: int,
    model: str | None = None,
    cluster: str | None = None,
    mode: str = "model",
    extra_env: dict[str, str] | None = None,
) -> RunResult:
    """Run ``command`` as ``real_rank`` of ``topology`` (in its node of ``cluster`` if given); returns exit code and record."""
    _require_command(command)
    if not 0 <= real_rank < topology.world_size:
        raise InputError(f"--rank: rank {real_rank} is not in 0-{topology.world_size - 1}")
    with owned_tempdir("nbox-run-") as tmp:  # removed by the next run if this one is killed
        topo_file = _write_topology(tmp, topology)
        record_file = Path(tmp) / "record.json"
        env = child_env(topo_file, topology, real_rank, record_file, model)
        env.update(extra_env or {})
        # Cluster hook (nbox run --cluster N [--mode wire]): the real rank runs inside its node's
        # namespace; wire mode also needs the stub peers up (neuronabox/cluster/stub.py).
        enter = _cluster_hook(env, topology, real_rank, cluster, mode) if cluster else None
        grace = _stop_grace()
        parent = os.getpid()

        def preexec() -> None:
            die_with_parent(parent)  # no orphan, even under kill -9 of nbox run (guard.py)
            if enter is not None:
                enter()

        try:
            child = subprocess.Popen(list(command), env=env, preexec_fn=preexec)
        except FileNotFoundError:
            what = "no such file" if os.sep in command[0] else "command not found"
            raise InputError(f"nbox run: {what}: {command[0]!r}") from None
        except PermissionError:
            raise InputError(f"nbox run: command not executable: {command[0]!r}") from None
        rc, stopped_by = _wait(child, grace)
        cannot = error_file(str(record_file))
        if rc == 2 and cannot.is_file():  # a spawned worker could not become a real rank: its one line
            raise InputError(cannot.read_text(encoding="utf-8").strip())
        records = _read_records(record_file, real_rank)
    record = records[min(records)] if records else None
    failures = {real_rank: f"real rank {real_rank} {describe_exit(rc)}"} if rc else {}
    return RunResult(rc, record, records, failures, stopped_by=stopped_by)


def _read_records(record_file: Path, real_rank: int) -> dict[int, dict[str, Any]]:
    """The records the command left: its own (``record_file``), or one per worker it spawned (``rank-<R>.json``)."""
    records = {int(p.stem.split("-", 1)[1]): json.loads(p.read_text(encoding="utf-8"))
               for p in record_file.parent.glob("rank-*.json") if p.stem.split("-", 1)[1].isdigit()}
    if record_file.exists() and real_rank not in records:
        records[real_rank] = json.loads(record_file.read_text(encoding="utf-8"))
    return records


def run_real_ranks(
    topology: Topology,
    command: Sequence[str],
    options,
    model: str | None = None,
    cluster: str | None = None,
    mode: str = "model",
    extra_env: dict[str, str] | None = None,
) -> RunResult:
    """Run ``command`` as several real ranks through torch's elastic launcher (``options``: a LaunchOptions)."""
    import contextlib

    from .elastic import plan_launch, run_elastic

    _require_command(command)
    if mode != "model":
        raise InputError(
            "--mode wire: not available with several real ranks (--nproc-per-node/--nnodes); use --mode model"
        )
    env = dict(os.environ)
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", ENV_REAL_RANK, "NBOX_RECORD"):
        env.pop(key, None)  # torch's agent sets the launch values; the worker turns them into the emulated ones
    env.update(extra_env or {})
    enter = contextlib.nullcontext()
    node_addr = env.get("NBOX_NODE_ADDR")
    plan = plan_launch(topology, options, node_addr)
    if cluster:
        node_addr, enter = _cluster_node(env, topology, plan.real_ranks, cluster)
        plan = plan_launch(topology, options, node_addr)
    with owned_tempdir("nbox-run-") as tmp:
        env[ENV_PARENT] = str(os.getpid())  # the workers' die_with_parent, in autostart
        _add_backend(env, _write_topology(tmp, topology), model)
        with enter:
            res = run_elastic(plan, command, env, Path(tmp))
    first = res.records[min(res.records)] if res.records else None
    return RunResult(res.returncode, first, res.records, res.failures, res.error, res.stopped_by)


def _require_healthy(cluster: str) -> None:
    """Refuse a cluster that is not up and healthy, after waiting out a fault that mends itself in seconds."""
    from ..cluster.runtime import status

    st = status(cluster, settle=10.0)[0]
    if st["phase"] != "up" or not st["healthy"]:
        raise InputError(f"--cluster {cluster}: the cluster is not up and healthy (phase {st['phase']!r}: "
                         f"{st.get('problem')}); run `nbox up` first")


def _cluster_node(env: dict[str, str], topology: Topology, real_ranks: list[int], cluster: str):
    """The node address and the namespace to launch in, for real ranks that all live on one node of ``cluster``."""
    import contextlib

    from ..cluster.namespace import Namespace
    from ..cluster.runtime import node_info

    _require_healthy(cluster)
    nodes = sorted({topology.node_of(r).name for r in real_ranks})
    if len(nodes) > 1:
        raise InputError(
            f"--cluster {cluster}: the real ranks live on {len(nodes)} nodes ({', '.join(nodes)}); start one launcher "
            "per node: nbox exec NODE -- nbox run ... --nnodes N --rdzv-endpoint NODE0_ADDR:PORT"
        )
    h = node_info(cluster, nodes[0])
    env.update({"NBOX_CLUSTER": cluster, "NBOX_NODE": h["node"], "NBOX_NODE_ADDR": h["address"]})
    # The agent, its store and the workers it starts all live in the node's namespace.
    return h["address"], (Namespace(h["ns"]).entered() if h.get("ns") else contextlib.nullcontext())


def _cluster_hook(env: dict[str, str], topology: Topology, real_rank: int, cluster: str, mode: str):
    """Point ``env`` at the cluster (and wire mode); returns the preexec_fn that enters the real node's namespace."""
    from ..cluster.namespace import Namespace
    from ..cluster.runtime import node_info
    from ..cluster.stub import ensure_stub, neighbour_nodes

    _require_healthy(cluster)

    def info(name: str) -> dict:
        # A cluster brought up from another topology lacks nodes this one runs on or talks to.
        try:
            return node_info(cluster, name)
        except InputError as exc:
            raise InputError(f"--cluster {cluster}: {exc}; {topology.source} needs it (`nbox up "
                             f"{topology.source}` brings up a cluster of that topology)") from None

    node = topology.node_of(real_rank).name
    h = info(node)
    env.update({"NBOX_CLUSTER": cluster, "NBOX_NODE": node, "NBOX_NODE_ADDR": h["address"]})
    if mode == "wire":
        env["NBOX_WIRE"] = "1"
        neighbours = neighbour_nodes(topology, [real_rank])
        for nb in neighbours:  # all checked before any stub starts
            info(nb)
        for nb in neighbours:
            ensure_stub(cluster, nb)
    return Namespace(h["ns"]).preexec() if h.get("ns") else None


# After a SIGTERM is passed on, how long the command has to write its record and end before it
# is killed (NBOX_STOP_GRACE, seconds: as a scheduler's kill wait, e.g. Slurm's KillWait of 30 s).
STOP_GRACE_S = 30.0
ENV_STOP_GRACE = "NBOX_STOP_GRACE"


def _stop_grace() -> float:
    """Seconds from NBOX_STOP_GRACE, else STOP_GRACE_S."""
    text = os.environ.get(ENV_STOP_GRACE, "").strip()
    try:
        value = float(text) if text else STOP_GRACE_S
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise InputError(f"{ENV_STOP_GRACE}: expected seconds (0 or more), got {text!r}")
    return value


class _Stopping(Exception):
    """nbox run got SIGTERM and passed it on: stop waiting without a limit."""


def _wait(child: subprocess.Popen, grace: float) -> tuple[int, str | None]:
    """The child's exit status, and SIGINT or SIGTERM if nbox was stopped meanwhile."""
    # Either signal is passed on, and the child writes its record before it dies (launcher.child.autostart);
    # one that does not end within the grace (stuck in a C call that never returns to Python) is
    # killed. Ctrl-C reaches the child by itself too (same process group) while `kill -INT` of nbox
    # does not: passing SIGINT on makes both the same, and autostart ignores the second copy.
    def forward(*_) -> None:
        child.send_signal(signal.SIGTERM)
        raise _Stopping

    previous = signal.signal(signal.SIGTERM, forward)
    deadline, stopped_by = None, None
    try:
        while True:
            try:
                if deadline is None:
                    return child.wait(), stopped_by
                try:
                    return child.wait(timeout=max(0.0, deadline - time.monotonic())), stopped_by
                except subprocess.TimeoutExpired:
                    child.kill()
                    return child.wait(), stopped_by
            except _Stopping:
                deadline = deadline or time.monotonic() + grace
                stopped_by = stopped_by or "SIGTERM"
            except KeyboardInterrupt:
                if stopped_by == "SIGINT":
                    child.kill()  # a second Ctrl-C: the user does not want to wait for the record
                else:
                    child.send_signal(signal.SIGINT)
                deadline = deadline or time.monotonic() + grace
                stopped_by = stopped_by or "SIGINT"
    finally:
        signal.signal(signal.SIGTERM, previous)
