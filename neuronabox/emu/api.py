"""The Python API for notebooks and scripts: ``init`` an emulated cluster, mark iterations, read the record.

    import neuronabox.emu.api as nbox
    nbox.init("cluster.yaml", rank=0)          # torch.distributed is now initialized: 1 real rank, the rest emulated
    ...  DDP / FSDP / plain collectives ...
    nbox.step()                                # optional: mark an iteration (optimizer steps do it otherwise)
    print(nbox.recorder().summary())
    nbox.shutdown()
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ..model.base import CommModel
from ..topology import Topology, load_topology, topology_from_dict
from . import emulator as _emulator
from .emulator import Emulator
from .environ import prepare_env
from .host_effects.compute_skew import StragglerHook
from .launch import install, uninstall
from .timeline import Recorder

__all__ = ["init", "step", "recorder", "current", "shutdown"]

_saved_env: dict[str, str | None] = {}


def _topology(topology: Topology | str | Path | dict[str, Any]) -> Topology:
    if isinstance(topology, Topology):
        return topology
    if isinstance(topology, dict):
        return topology_from_dict(topology)
    return load_topology(topology)


def init(
    topology: Topology | str | Path | dict[str, Any],
    rank: int = 0,
    model: CommModel | str | None = None,
    *,
    straggler: StragglerHook | None = None,
    contention: bool | None = None,
    init_process_group: bool = True,
) -> Emulator:
    """Emulate ``topology`` with this process as ``rank``; initializes torch.distributed unless told not to."""
    topo = _topology(topology)
    emu = Emulator(topo, rank, model, straggler, contention)
    _emulator.set_current(emu)
    install()
    env = prepare_env(topo, rank)
    for key in env:  # shutdown() puts these back: a notebook or a test session outlives the emulation
        _saved_env.setdefault(key, os.environ.get(key))
    os.environ.update(env)
    if init_process_group:
        import torch.distributed as dist

        if not dist.is_initialized():
            dist.init_process_group()
    return emu


def current() -> Emulator:
    """The emulator in use."""
    return _emulator.current()


def step() -> None:
    """Mark the end of an iteration now (from then on optimizer steps no longer mark iterations)."""
    _emulator.current().recorder.mark_iteration(manual=True)


def recorder() -> Recorder:
    """Every emulated op and iteration boundary so far."""
    return _emulator.current().recorder


def shutdown() -> Recorder | None:
    """Destroy the process groups, undo ``install``, restore the environment and forget the emulator; returns its recorder."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    uninstall()
    for key, value in _saved_env.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    _saved_env.clear()
    emu = _emulator._current
    _emulator.set_current(None)
    return emu.recorder if emu is not None else None
