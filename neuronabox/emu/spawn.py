"""Scripts that start their own workers (``mp.spawn``, ``torch.multiprocessing``): each worker is one real rank.

The PyTorch "Getting started with DDP" pattern: ``nbox run`` starts the script once, the
script starts ``world_size`` workers itself, and each calls
``init_process_group("gloo", rank=rank, world_size=world_size)`` after setting its own
MASTER_ADDR/MASTER_PORT. A worker is recognised at that call: it is a multiprocessing child
(``multiprocessing.parent_process()``), it names its rank and world size, nbox's own launcher
did not start it (``--nproc-per-node`` workers already carry the emulated world) and no emulator
exists in it yet.

Such a worker becomes world rank ``R + rank`` of the topology, where R is the run's real rank
(``--rank``, default the topology's first real rank): the script's workers are real ranks R ..
R+world_size-1, the rest of the topology is emulated, and groups holding two or more of them
run for real among them (``hybrid.py``). The real ranks' store is the script's own address
(MASTER_ADDR/MASTER_PORT, or ``init_method="tcp://HOST:PORT"``), hosted by worker 0 as torch's
``env://`` would. Each worker writes its record to ``rank-<world rank>.json`` beside the file
``NBOX_RECORD`` names, where ``nbox run`` collects them.

What cannot be (more workers than the topology has ranks from R, no address for the store)
ends the worker with status 2 and one line that says what to change; the line goes to
``spawn-error.txt`` beside the record (``nbox run`` prints it, and the script's parent process
exits 2 quietly instead of printing the spawn traceback) or, without a record, to stderr.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from urllib.parse import urlparse

from ..errors import InputError

__all__ = ["is_spawned_worker", "enter_spawned_worker", "error_file", "ENV_SPAWNED"]

# Set in a worker once it became a real rank: its own Python children are not workers of the script.
ENV_SPAWNED = "NBOX_SPAWNED"
ERROR_NAME = "spawn-error.txt"
STORE_PREFIX = "nbox-spawn/"

_server = []  # worker 0's TCPStore server, alive as long as the process


def error_file(record: str | None = None) -> Path | None:
    """Where a spawned worker leaves the line that says why it cannot run (beside NBOX_RECORD), if anywhere."""
    record = record if record is not None else os.environ.get("NBOX_RECORD")
    return Path(record).with_name(ERROR_NAME) if record else None


def is_spawned_worker(world_size, rank) -> bool:
    """Whether this ``init_process_group(rank=, world_size=)`` call comes from a worker the script started itself."""
    import multiprocessing

    from . import emulator
    from .environ import ENV_ELASTIC

    if world_size in (-1, None) or rank in (-1, None) or not os.environ.get(emulator.ENV_TOPOLOGY):
        return False  # no nbox run around it (api.init in the script): nothing to map the worker onto
    if os.environ.get(ENV_ELASTIC) or os.environ.get(ENV_SPAWNED) or emulator._current is not None:
        return False
    return multiprocessing.parent_process() is not None


def _store_address(init_method: str | None) -> tuple[str, int]:
    """The real ranks' store: the script's tcp:// init_method, else its MASTER_ADDR/MASTER_PORT."""
    if init_method and init_method.startswith("tcp://"):
        url = urlparse(init_method)
        if url.hostname and url.port:
            return url.hostname, url.port
    if init_method and not init_method.startswith(("env://", "tcp://")):
        raise InputError(f"init_process_group(init_method={init_method!r}) in a spawned worker: use env:// "
                         "(MASTER_ADDR/MASTER_PORT) or tcp://HOST:PORT, which the real ranks' store can listen on")
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT", "")
    if not addr or not port.isdigit():
        raise InputError("a spawned worker called init_process_group with no MASTER_ADDR/MASTER_PORT: set both "
                         "before init_process_group, or pass init_method='tcp://HOST:PORT'")
    return addr, int(port)


def _fail(message: str) -> None:
    """End the worker with status 2; the line goes where ``nbox run`` reads it (else to stderr)."""
    path = error_file()
    if path is not None:
        try:
            with open(path, "x", encoding="utf-8") as f:  # the first worker's line wins
                f.write(message + "\n")
        except FileExistsError:
            pass
    else:
        sys.stderr.write(f"nbox: {message}\n")
        sys.stderr.flush()
    os._exit(2)  # no traceback, no atexit: the worker never became a rank


def enter_spawned_worker(rank: int, world_size: int, init_method: str | None) -> None:
    """Make this worker world rank R + ``rank`` of the topology (environment, store, record); exits 2 if it cannot be."""
    try:
        _enter(int(rank), int(world_size), init_method)
    except InputError as exc:
        _fail(str(exc))


def _enter(rank: int, world: int, init_method: str | None) -> None:
    from ..topology.resolve import load_topology
    from .environ import ENV_REAL_RANK, ENV_REAL_RANKS, ENV_REAL_STORE, ENV_REAL_STORE_PREFIX, ENV_TOPOLOGY
    from .environ import prepare_env

    topology = load_topology(os.environ[ENV_TOPOLOGY])
    base = int(os.environ.get(ENV_REAL_RANK, "0"))
    if world < 1 or not 0 <= rank < world:
        raise InputError(f"init_process_group(rank={rank}, world_size={world}) in a spawned worker: "
                         f"rank must be in 0-{world - 1}")
    if base + world > topology.world_size:
        raise InputError(
            f"the script starts {world} workers (init_process_group world_size={world}) but topology {topology.name!r} "
            f"has {topology.world_size - base} ranks from the real rank {base}: use a topology of at least "
            f"{base + world} ranks, or start fewer workers"
        )
    addr, port = _store_address(init_method)
    me = base + rank
    env = prepare_env(topology, me, port, master_addr=addr)
    env[ENV_REAL_RANKS] = ",".join(str(base + k) for k in range(world))
    env[ENV_REAL_STORE] = f"{addr}:{port}"
    env[ENV_REAL_STORE_PREFIX] = STORE_PREFIX
    env[ENV_SPAWNED] = "1"
    record = os.environ.get("NBOX_RECORD")
    if record:
        env["NBOX_RECORD"] = str(Path(record).with_name(f"rank-{me}.json"))
    os.environ.update(env)
    if rank == 0 and world > 1:
        # As torch's env:// rendezvous: rank 0 hosts the store the others connect to.
        import datetime

        import torch.distributed as dist

        try:
            _server.append(dist.TCPStore(addr, port, is_master=True, wait_for_workers=False,
                                         timeout=datetime.timedelta(seconds=300)))
        except Exception as exc:  # noqa: BLE001 - a taken port or an address not of this machine: one line
            raise InputError(f"spawned worker 0 cannot listen on MASTER_ADDR:MASTER_PORT={addr}:{port} for the "
                             f"real ranks' store ({exc}): pick a free port") from None
