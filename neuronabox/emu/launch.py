"""Running an unmodified script as one rank of an emulated job: torchrun's environment, backend substitution.

``prepare_env`` gives the environment torchrun would give the real rank. ``install`` makes
``init_process_group`` with ``"nccl"``, ``"gloo"``, ``None``, ``"cpu:gloo,cuda:nccl"`` (any
backend, in fact) create ``nbox`` process groups, and so do ``new_group`` and
``init_device_mesh``: every group is created through ``distributed_c10d._new_process_group_helper``,
which is wrapped to pass ``backend="nbox"``. Groups are created with torch's extended
backend API, so each one knows its global ranks and the model sees the right group.

The store: the real rank must not wait for ranks that never come. ``init_process_group``
is wrapped to hand torch a local ``HashStore`` (no rendezvous, no TCP server waiting for
WORLD_SIZE workers), and ``TORCH_DIST_INIT_BARRIER=0`` keeps init from its store barrier.

Iterations: the end of each optimizer step marks an iteration (the first optimizer that
steps defines them), unless the user marks them with ``neuronabox.emu.api.step()``.
"""

from __future__ import annotations

import functools
import inspect
import os
import socket
import uuid
import weakref
from pathlib import Path

import wrapt

from ..topology import Topology
from .emulator import ENV_REAL_RANK, current
from .group_table import TABLE
from .spawn import enter_spawned_worker, error_file, is_spawned_worker

__all__ = ["prepare_env", "install", "uninstall", "installed", "free_port", "run_script", "child_pythonpath"]

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


# What install() replaced: (module, attribute) -> original; empty when not installed.
_originals: dict[tuple[object, str], object] = {}
_hook_handle = None
_pre_hook_handles: list = []
_stage_hook = False
_saved_barrier: list[str | None] = []


def installed() -> bool:
    """Whether ``install`` is in effect."""
    return bool(_originals)


def _patch(module, name: str, replacement) -> None:
    if hasattr(module, name) and (module, name) not in _originals:
        _originals[(module, name)] = getattr(module, name)
        setattr(module, name, replacement)


def install() -> None:
    """Route every torch.distributed process group of this process to the nbox backend (idempotent)."""
    global _hook_handle
    if _originals:
        return
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d
    from torch.optim.optimizer import (  # torch.optim deletes its submodule names
        register_optimizer_step_post_hook,
        register_optimizer_step_pre_hook,
    )

    from .backend import BACKEND_NAME, NboxProcessGroup, register

    register()
    _saved_barrier.append(os.environ.get("TORCH_DIST_INIT_BARRIER"))
    os.environ["TORCH_DIST_INIT_BARRIER"] = "0"

    original_init = c10d.init_process_group
    init_sig = inspect.signature(original_init)

    @functools.wraps(original_init)
    def init_process_group(*args, **kwargs):
        bound = init_sig.bind(*args, **kwargs)
        a = bound.arguments
        world = a.get("world_size", -1)
        rank = a.get("rank", -1)
        spawned = is_spawned_worker(world, rank)
        if spawned:  # a worker the script started itself (mp.spawn) becomes one real rank (spawn.py)
            enter_spawned_worker(rank, world, a.get("init_method"))
        emu = current()
        a["backend"] = BACKEND_NAME
        # A device binding would make torch split NCCL communicators eagerly (_get_backend on our group).
        a["device_id"] = None
        if a.get("store") is None:
            a["store"] = dist.HashStore()
            a["init_method"] = None
        if not spawned and world not in (-1, None) and world != emu.world_size:
            raise ValueError(f"nbox: init_process_group(world_size={world}) but the emulated world has {emu.world_size}")
        if not spawned and rank not in (-1, None) and rank != emu.real_rank:
            raise ValueError(f"nbox: init_process_group(rank={rank}) but the real rank is {emu.real_rank}")
        a["world_size"] = emu.world_size
        a["rank"] = emu.real_rank
        TABLE.start_world(emu.world_size)
        try:
            return original_init(*bound.args, **bound.kwargs)
        finally:
            TABLE.creating = None

    original_new_group = c10d._new_group_with_tag
    new_group_sig = inspect.signature(original_new_group)

    @functools.wraps(original_new_group)
    def new_group_with_tag(*args, **kwargs):
        # Every rank creates every group in the same order: the table names communicators across roles.
        bound = new_group_sig.bind(*args, **kwargs)
        bound.apply_defaults()
        ranks = bound.arguments.get("ranks")
        ranks = list(range(dist.get_world_size())) if not ranks else list(ranks)
        TABLE.creating = TABLE.add(sorted(ranks) if bound.arguments.get("sort_ranks", True) else ranks)
        try:
            return original_new_group(*args, **kwargs)
        finally:
            TABLE.creating = None

    original_helper = c10d._new_process_group_helper
    helper_sig = inspect.signature(original_helper)

    @functools.wraps(original_helper)
    def new_process_group_helper(*args, **kwargs):
        bound = helper_sig.bind(*args, **kwargs)
        bound.arguments["backend"] = dist.Backend(BACKEND_NAME)
        if "device_id" in bound.arguments:
            bound.arguments["device_id"] = None
        return original_helper(*bound.args, **bound.kwargs)

    original_monitored = c10d.monitored_barrier

    @functools.wraps(original_monitored)
    def monitored_barrier(group=None, timeout=None, wait_all_ranks=False):
        pg = group if group is not None else c10d._get_default_group()
        if isinstance(pg, NboxProcessGroup):  # torch allows monitored_barrier for gloo only
            return pg.monitored_barrier(timeout, wait_all_ranks)
        return original_monitored(group, timeout, wait_all_ranks)

    original_bcast_objects = c10d.broadcast_object_list
    bcast_sig = inspect.signature(original_bcast_objects)

    @functools.wraps(original_bcast_objects)
    def broadcast_object_list(*args, **kwargs):
        # From an emulated root, torch would unpickle whatever the size buffer held. Mirror
        # semantics: the root's objects are ours, so broadcast from the real rank instead.
        bound = bcast_sig.bind(*args, **kwargs)
        a = bound.arguments
        pg = a.get("group") or c10d._get_default_group()
        if isinstance(pg, NboxProcessGroup):
            a["src"] = None
            a["group_src"] = pg.rank()
        return original_bcast_objects(*bound.args, **bound.kwargs)

    _patch(c10d, "broadcast_object_list", broadcast_object_list)
    _patch(dist, "broadcast_object_list", broadcast_object_list)
    _patch(c10d, "init_process_group", init_process_group)
    _patch(dist, "init_process_group", init_process_group)
    _patch(c10d, "_new_process_group_helper", new_process_group_helper)
    _patch(c10d, "_new_group_with_tag", new_group_with_tag)
    _patch(c10d, "monitored_barrier", monitored_barrier)
    _patch(dist, "monitored_barrier", monitored_barrier)
    try:  # init_device_mesh calls the init_process_group it imported
        import torch.distributed.device_mesh as device_mesh

        _patch(device_mesh, "init_process_group", init_process_group)
        original_mesh = device_mesh.init_device_mesh
        mesh_sig = inspect.signature(original_mesh)

        @functools.wraps(original_mesh)
        def init_device_mesh(*args, **kwargs):
            # A role profile keeps the mesh: roles named by dimension (--roles pp) come from it.
            bound = mesh_sig.bind(*args, **kwargs)
            emu = current()
            if emu.role_recorder is not None:
                emu.role_recorder.note_mesh(tuple(bound.arguments.get("mesh_shape") or ()),
                                            bound.arguments.get("mesh_dim_names"))
            return original_mesh(*args, **kwargs)

        _patch(device_mesh, "init_device_mesh", init_device_mesh)
        _patch(dist, "init_device_mesh", init_device_mesh)
    except ImportError:
        pass
    _patch_spawn_join()
    global _stage_hook
    if not _stage_hook:  # a hook fires once per import: registered once per process, it wraps once
        _stage_hook = True
        wrapt.register_post_import_hook(_note_pipeline_stages, "torch.distributed.pipelining.stage")
    _patch_dtensor_scatter(NboxProcessGroup)  # after the patches above: installed() is what its hook checks

    first_optimizer: list[weakref.ref] = []

    def step_post_hook(optimizer, args, kwargs):
        # Several optimizers (a GAN, per-group optimizers) step once each per iteration: only
        # the first one that steps marks iterations; if it is gone, the next one takes over.
        if not first_optimizer or first_optimizer[0]() is None:
            first_optimizer[:] = [weakref.ref(optimizer)]
        elif first_optimizer[0]() is not optimizer:
            return
        from . import emulator

        if emulator._current is not None:
            emulator._current.recorder.mark_iteration()

    def step_pre_hook(optimizer, args, kwargs):
        # A role being profiled: the optimizer steps once every op it issued is done (DDP and FSDP
        # wait on their futures from C++, unseen by Python).
        from . import emulator

        emu = emulator._current
        if emu is not None and emu.role_recorder is not None and first_optimizer and first_optimizer[0]() is optimizer:
            emu.role_recorder.sync()

    _hook_handle = register_optimizer_step_post_hook(step_post_hook)
    _pre_hook_handles.append(register_optimizer_step_pre_hook(step_pre_hook))


def _patch_spawn_join() -> None:
    """In the script's own process: a worker that could not become a real rank ends the script with 2, quietly.

    The worker left its one line for ``nbox run`` (spawn.py); torch's spawn would wrap its exit
    in a traceback that buries that line.
    """
    import logging

    from torch.multiprocessing.spawn import ProcessContext, ProcessExitedException

    original_join = ProcessContext.join
    spawn_log = logging.getLogger("torch.multiprocessing.spawn")

    def ours(path) -> bool:
        return path is not None and path.is_file()

    def quiet(record: logging.LogRecord) -> bool:
        # torch logs one "Terminating process ..." line per sibling it stops: noise beside our line.
        return not ours(error_file())

    @functools.wraps(original_join)
    def join(self, *args, **kwargs):
        spawn_log.addFilter(quiet)
        try:
            return original_join(self, *args, **kwargs)
        except ProcessExitedException as exc:
            if exc.exit_code == 2 and ours(error_file()):
                raise SystemExit(2) from None
            raise
        finally:
            spawn_log.removeFilter(quiet)

    _patch(ProcessContext, "join", join)


def _note_pipeline_stages(stage_module) -> None:
    # A role profile keeps which pipeline stages a rank holds: roles can be inferred from them.
    def after_init(wrapped, instance, args, kwargs):
        result = wrapped(*args, **kwargs)
        from . import emulator

        emu = emulator._current
        if emu is not None and emu.role_recorder is not None:
            import torch.distributed as dist

            group = getattr(instance, "group", None)
            ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
            emu.role_recorder.note_stage(instance.stage_index, instance.num_stages, ranks)
        return result

    wrapt.wrap_function_wrapper(stage_module, "_PipelineStageBase.__init__", after_init)


def _patch_dtensor_scatter(group_class) -> None:
    # DTensor's distribute_tensor splits the full tensor on every rank, then scatters the
    # pieces from mesh coordinate 0 into torch.empty_like buffers. From an emulated root our
    # scatter would leave those uninitialized; mirror semantics says the root's pieces are the
    # ones we split, so scatter from ourselves. Importing DTensor costs 1.8 s of start-up on a
    # 2-core machine and DDP never does, so the patch waits until the script imports it.
    wrapt.register_post_import_hook(functools.partial(_patch_mesh_scatter, group_class), "torch.distributed.tensor")


def _patch_mesh_scatter(group_class, _tensor_package) -> None:
    if not installed():  # a hook left from an install that was undone before DTensor came
        return
    import torch.distributed.tensor._collective_utils as cu
    import torch.distributed.tensor.placement_types as pt

    original = _originals.get((cu, "mesh_scatter"), cu.mesh_scatter)
    sig = inspect.signature(original)

    @functools.wraps(original)
    def mesh_scatter(*args, **kwargs):
        bound = sig.bind(*args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        if a["group_src"] is not None and a["scatter_list"] is not None:
            pg = a["mesh"].get_group(a["mesh_dim"])
            if isinstance(pg, group_class):
                a["group_src"] = pg.rank()
        return original(*bound.args, **bound.kwargs)

    # placement_types imported mesh_scatter by name
    _patch(cu, "mesh_scatter", mesh_scatter)
    _patch(pt, "mesh_scatter", mesh_scatter)


def uninstall() -> None:
    """Undo ``install`` (the nbox backend stays registered; torch has no way to unregister one)."""
    global _hook_handle
    for (module, name), original in _originals.items():
        setattr(module, name, original)
    _originals.clear()
    if _hook_handle is not None:
        _hook_handle.remove()
        _hook_handle = None
    while _pre_hook_handles:
        _pre_hook_handles.pop().remove()
    while _saved_barrier:
        value = _saved_barrier.pop()
        if value is None:
            os.environ.pop("TORCH_DIST_INIT_BARRIER", None)
        else:
            os.environ["TORCH_DIST_INIT_BARRIER"] = value


def run_script(argv: list[str]) -> None:
    """Run ``argv[0]`` (a script path, or ``-m module``) as ``__main__`` with the nbox backend installed.

    The child side of ``nbox run``: the parent sets ``prepare_env(...)`` plus ``NBOX_TOPOLOGY``
    (and optionally ``NBOX_MODEL``); if ``NBOX_RECORD`` names a file, the recorder is written
    there as JSON when the script ends, even by an exception or ``sys.exit``.
    """
    import runpy
    import sys

    if not argv:
        raise SystemExit("usage: python -m neuronabox.emu.launch SCRIPT [ARGS...] | -m MODULE [ARGS...]")
    autostart()
    if argv[0] == "-m" and len(argv) > 1:
        sys.argv = argv[1:]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(argv)
        sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
        runpy.run_path(argv[0], run_name="__main__")


def autostart() -> None:
    """Install the backend in a process started by ``nbox run`` once it imports torch; write its record at exit."""
    import atexit

    # Importing torch costs 2.5-3 s of start-up on a 2-core machine: a process of the run that
    # never imports it (a wrapper, a tool the script spawns) should not pay that.
    wrapt.register_post_import_hook(_start_emulating, "torch")
    out = os.environ.get("NBOX_RECORD")
    if out:
        # Read at exit: a worker the script spawned re-points NBOX_RECORD at its own file (spawn.py).
        atexit.register(lambda: _write_record(os.environ.get("NBOX_RECORD") or out))
        _record_on_sigterm(out)
        _record_on_sigint(out)


def _start_emulating(_torch) -> None:
    from ..metrics import start_from_env

    install()
    start_from_env()  # the Prometheus exporter (NBOX_METRICS_ADDR) and the progress file, when asked for


def _record_on_sigterm(path: str) -> None:
    """Write the record before SIGTERM's default action, which ends the process without its atexit handlers."""
    import signal
    import threading

    # Only where SIGTERM would simply kill: a script's own handler (set before or after this)
    # keeps its meaning, and one that exits through sys.exit writes the record at exit anyway.
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return

    def on_term(signum, frame) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        try:
            _write_record(os.environ.get("NBOX_RECORD") or path)
        finally:
            os.kill(os.getpid(), signal.SIGTERM)  # and die by it, as before: the parent sees status -15

    signal.signal(signal.SIGTERM, on_term)


def _record_on_sigint(path: str) -> None:
    """Ctrl-C: write the record and end as SIGINT's default action would, instead of a traceback from a collective."""
    import signal
    import threading

    # A KeyboardInterrupt raised inside a collective that torch called from C++ (DDP's reducer)
    # comes out as "RuntimeError: Cannot extract tensors from value: KeyboardInterrupt" and a
    # 15-line traceback. A script's own SIGINT handler keeps its meaning; so does a process of
    # the run that emulates nothing (a wrapper, a DataLoader worker forked from the rank).
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        return
    import sys

    owner, busy = os.getpid(), []

    def on_int(signum, frame) -> None:
        emulator = sys.modules.get(__package__ + ".emulator")  # not imported: this process emulates nothing
        if os.getpid() != owner or emulator is None or emulator._current is None:
            raise KeyboardInterrupt
        if busy:  # nbox run passes Ctrl-C on as well: the second copy must not cut the record short
            return
        busy.append(signum)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            _write_record(path)
        finally:
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)  # the parent sees status -2, as after a plain Ctrl-C

    signal.signal(signal.SIGINT, on_int)


def _write_record(path: str) -> None:
    import json

    from . import emulator

    emu = emulator._current
    if emu is None:
        return
    rec = emu.recorder
    rec.resolve()
    data = {
        "world_size": emu.world_size,
        "real_rank": emu.real_rank,
        "model": getattr(emu.model, "name", type(emu.model).__name__),
        "iterations": rec.iteration_times(),
        "device_iterations": rec.device_iteration_times(),
        "communicators": {tl.name: list(tl.group.ranks) for tl in emu.timelines},
        "ops": [r.as_dict(rec.t0) for r in rec.ops],
    }
    if emu.replay is not None:
        data["roles"] = emu.replay.summary(rec.t0)
        data["roles"]["_real"] = {"rank": emu.real_rank, "role": emu.replay.roles.role_of(emu.real_rank)}
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f)


if __name__ == "__main__":
    import sys

    # Use the package's copy of this module, whose install() state the rest of nbox sees.
    from neuronabox.emu.launch import run_script as _run_script

    _run_script(sys.argv[1:])
