"""The parent side of ``nbox run``: start the user's command as the real rank, wait, collect its record.

The command runs unmodified in a child process whose environment is what torchrun would
give the real rank, plus ``NBOX_TOPOLOGY`` (the effective topology, what-if flags merged) and
a ``PYTHONPATH`` entry whose ``sitecustomize`` installs the nbox backend before user code runs.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import yaml

from ..errors import InputError
from ..topology import Topology
from .emulator import ENV_MODEL, ENV_REAL_RANK, ENV_TOPOLOGY
from .launch import prepare_env

__all__ = ["RunResult", "run_command", "AUTOSTART_DIR"]

AUTOSTART_DIR = Path(__file__).resolve().parent / "autostart"
_PACKAGE_PARENT = Path(__file__).resolve().parents[2]


@dataclass
class RunResult:
    """How the command ended and what the real rank recorded (None if it never used torch.distributed)."""

    returncode: int
    record: dict[str, Any] | None


def child_env(topology_file: Path, topology: Topology, real_rank: int, record: Path, model: str | None) -> dict[str, str]:
    """The real rank's environment: torchrun's contract plus what the nbox backend needs."""
    env = dict(os.environ)
    env.update(prepare_env(topology, real_rank))
    env[ENV_TOPOLOGY] = str(topology_file)
    env[ENV_REAL_RANK] = str(real_rank)
    env["NBOX_RECORD"] = str(record)
    if model:
        env[ENV_MODEL] = model
    paths = [str(AUTOSTART_DIR), str(_PACKAGE_PARENT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


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
    if not command:
        raise InputError("nbox run: no command to run (usage: nbox run TOPOLOGY [OPTIONS] -- python train.py ARGS)")
    if not 0 <= real_rank < topology.world_size:
        raise InputError(f"--rank: rank {real_rank} is not in 0-{topology.world_size - 1}")
    with tempfile.TemporaryDirectory(prefix="nbox-run-") as tmp:
        topo_file = Path(tmp) / "topology.yaml"
        topo_file.write_text(yaml.safe_dump(_jsonable(topology.raw), sort_keys=False), encoding="utf-8")
        record_file = Path(tmp) / "record.json"
        env = child_env(topo_file, topology, real_rank, record_file, model)
        env.update(extra_env or {})
        # Cluster hook (nbox run --cluster N [--mode wire]): the real rank runs inside its node's
        # namespace; wire mode also needs the stub peers up (neuronabox/cluster/stub.py).
        preexec = _cluster_hook(env, topology, real_rank, cluster, mode) if cluster else None
        try:
            child = subprocess.Popen(list(command), env=env, preexec_fn=preexec)
        except FileNotFoundError:
            raise InputError(f"nbox run: command not found: {command[0]!r}") from None
        except PermissionError:
            raise InputError(f"nbox run: command not executable: {command[0]!r}") from None
        rc = _wait(child)
        record = json.loads(record_file.read_text(encoding="utf-8")) if record_file.exists() else None
    return RunResult(rc, record)


def _cluster_hook(env: dict[str, str], topology: Topology, real_rank: int, cluster: str, mode: str):
    """Point ``env`` at the cluster (and wire mode); returns the preexec_fn that enters the real node's namespace."""
    from ..cluster.netns import Namespace
    from ..cluster.runtime import node_info, status
    from ..cluster.stub import ensure_stub, neighbour_nodes

    st = status(cluster)[0]
    if st["phase"] != "up" or not st["healthy"]:
        raise InputError(f"--cluster {cluster}: the cluster is not up and healthy (phase {st['phase']!r}); "
                         "run `nbox up` first")
    node = topology.node_of(real_rank).name
    h = node_info(cluster, node)
    env.update({"NBOX_CLUSTER": cluster, "NBOX_NODE": node, "NBOX_NODE_ADDR": h["address"]})
    if mode == "wire":
        env["NBOX_WIRE"] = "1"
        for nb in neighbour_nodes(topology, [real_rank]):
            ensure_stub(cluster, nb)
    return Namespace(h["ns"]).preexec() if h.get("ns") else None


def _wait(child: subprocess.Popen) -> int:
    # Ctrl-C reaches the child too (same process group); give it time to write its record.
    forward = signal.signal(signal.SIGTERM, lambda *_: child.send_signal(signal.SIGTERM))
    try:
        while True:
            try:
                return child.wait()
            except KeyboardInterrupt:
                try:
                    return child.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    child.kill()
    finally:
        signal.signal(signal.SIGTERM, forward)


def _jsonable(value: Any) -> Any:
    """The raw topology with enum keys (from what-if merges) turned back into YAML scalars."""
    if isinstance(value, dict):
        return {(k.value if hasattr(k, "value") else k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value.value if hasattr(value, "value") else value
