"""Running an unmodified script as one rank of an emulated job: torchrun's environment, backend substitution.

``install`` makes
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
import weakref

import wrapt

from .emulator import current
from .group_table import TABLE
from .spawn import enter_spawned_worker, error_file, is_spawned_worker

__all__ = ["install", "uninstall", "installed"]

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

    register(current)
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
