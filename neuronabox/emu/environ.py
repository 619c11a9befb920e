"""The environment a launcher owes the emulator: the variables a process of the run reads at start-up.

``nbox run`` (``neuronabox.launcher``), the elastic agent's workers and a script's own
``mp.spawn`` workers set them; the emulator, its hybrid collectives and the spawn patch read
them. One place for the names, so the two sides cannot drift apart. ``prepare_env`` gives the
environment torchrun would give the real rank.
"""

from __future__ import annotations

import os
import socket
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..topology import Topology

__all__ = [
    "child_pythonpath", "free_port", "prepare_env", "ENV_ELASTIC", "ENV_MODEL", "ENV_REAL_RANK", "ENV_REAL_RANKS", "ENV_REAL_STORE", "ENV_REAL_STORE_PREFIX",
    "ENV_REAL_TIMEOUT", "ENV_TOPOLOGY",
]

ENV_TOPOLOGY = "NBOX_TOPOLOGY"
ENV_MODEL = "NBOX_MODEL"
ENV_REAL_RANK = "NBOX_REAL_RANK"
ENV_REAL_RANKS = "NBOX_REAL_RANKS"  # all real ranks of the run, "0,1,..." (hybrid collectives when several)
ENV_REAL_STORE = "NBOX_REAL_STORE"
ENV_REAL_STORE_PREFIX = "NBOX_REAL_STORE_PREFIX"
ENV_REAL_TIMEOUT = "NBOX_REAL_TIMEOUT"
# Set by the parent for the workers: "1" = translate torchrun's environment; "done" once translated,
# so Python subprocesses of the worker (which inherit the translated environment) leave it alone.
ENV_ELASTIC = "NBOX_ELASTIC"


# The folder holding the neuronabox package: a child process started from a checkout imports it from there.
PACKAGE_PARENT = Path(__file__).resolve().parents[2]


def child_pythonpath(*first: Path | str) -> str:
    """A child process's PYTHONPATH: ``first`` (folders whose sitecustomize must run), this package's folder, then ours."""
    ours = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return os.pathsep.join([str(p) for p in first] + [str(PACKAGE_PARENT)] + ours)


def free_port() -> int:
    """A TCP port that is free on 127.0.0.1 now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prepare_env(
    topology: Topology,
    real_rank: int = 0,
    master_port: int | None = None,
    *,
    master_addr: str = "127.0.0.1",
    run_id: str | None = None,
) -> dict[str, str]:
    """The environment torchrun sets for ``real_rank`` of the emulated world (strings, ready for ``os.environ``)."""
    world = topology.world_size
    if not 0 <= real_rank < world:
        raise ValueError(f"real rank {real_rank} is outside the world of {world} ranks")
    node = topology.node_of(real_rank)
    port = master_port if master_port is not None else free_port()
    return {
        "RANK": str(real_rank),
        "LOCAL_RANK": str(topology.local_rank(real_rank)),
        "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(node.ranks),
        "GROUP_RANK": str(node.index),
        "GROUP_WORLD_SIZE": str(len(topology.nodes)),
        "ROLE_NAME": "default",
        "ROLE_RANK": str(real_rank),
        "ROLE_WORLD_SIZE": str(world),
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(port),
        "TORCHELASTIC_RUN_ID": run_id or f"nbox-{uuid.uuid4().hex[:12]}",
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0",
        "TORCHELASTIC_USE_AGENT_STORE": "False",
        "TORCH_DIST_INIT_BARRIER": "0",
        ENV_REAL_RANK: str(real_rank),
    }
