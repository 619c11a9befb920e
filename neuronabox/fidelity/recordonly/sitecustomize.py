"""Started by ``nbox validate`` for the ranks of the real system: this folder goes first on PYTHONPATH.

Record-only mode: the real gloo backend stays in place, nothing about collectives changes.
Only the iteration boundaries are recorded, the same way ``nbox run`` marks them (the end
of the first optimizer's step), and written as JSON to ``NBOX_RECORD`` at exit (``{rank}`` in
it becomes the rank: ``nbox record``), in the record format that
``neuronabox.report.run_summary.summarize`` reads. A ``sitecustomize``
that this one shadows is still run afterwards.
"""

import os
import sys


def _chain_shadowed_sitecustomize() -> None:
    # Standalone like launcher/autostart/sitecustomize.py (it runs before neuronabox may be importable),
    # so the two keep their own copy of this.
    import importlib.machinery  # not an attribute of importlib until someone imports it
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    path = [p for p in sys.path if os.path.abspath(p or ".") != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is not None and spec.loader is not None:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)


def _install(out: str) -> None:
    import atexit
    import json
    import time
    import weakref

    try:
        from torch.optim.optimizer import register_optimizer_step_post_hook
    except ImportError as exc:
        sys.stderr.write(f"nbox validate: this Python ({sys.executable}) has no torch ({exc}); nothing is recorded\n")
        return
    # nbox run starts its clock when the emulator is built, inside init_process_group; the
    # first iteration (set-up) is a warm-up in both systems, so the start only has to be close.
    t0 = [time.perf_counter()]
    marks: list[float] = []
    first: list = []
    inited: list[bool] = []

    try:
        import torch.distributed as dist

        original = dist.init_process_group

        def init_process_group(*args, **kwargs):
            result = original(*args, **kwargs)
            inited.append(True)
            if not marks:
                t0[0] = time.perf_counter()
            return result

        init_process_group.__wrapped__ = original
        dist.init_process_group = init_process_group
    except ImportError:
        pass

    def step_post_hook(optimizer, args, kwargs):
        # As nbox run: only the first optimizer that steps marks iterations.
        if not first or first[0]() is None:
            first[:] = [weakref.ref(optimizer)]
        elif first[0]() is not optimizer:
            return
        marks.append(time.perf_counter())

    register_optimizer_step_post_hook(step_post_hook)

    def write() -> None:
        import socket

        if not inited and not marks:
            return  # a launcher's own Python (torchrun's agent) is no rank: it must not write rank-0

        edges = [t0[0]] + marks
        rank = int(os.environ.get("RANK", "0"))
        data = {
            "world_size": int(os.environ.get("WORLD_SIZE", "1")),
            "real_rank": rank,
            "model": "real (gloo)",
            "host": socket.gethostname(),
            "argv": list(sys.argv),
            "iterations": [b - a for a, b in zip(edges, edges[1:])],
            "device_iterations": [],
            "communicators": {},
            "ops": [],
        }
        # nbox record names one file per rank ("rank-{rank}.json"): every rank of a launcher writes its own.
        path = out.replace("{rank}", str(rank))
        with open(path + ".tmp", "w", encoding="utf-8") as f:
            json.dump(data, f)
        os.replace(path + ".tmp", path)

    atexit.register(write)

    try:
        import torch.distributed as dist

        destroy = dist.destroy_process_group

        def destroy_process_group(group=None):
            # gloo can abort a rank that tears down while its peer still talks to it ("terminate
            # called without an active exception"): write the record first (an abort skips atexit),
            # then let every rank reach teardown together.
            if group is None and dist.is_initialized():
                write()
                try:
                    dist.barrier()
                except Exception:  # a peer already gone: teardown goes on regardless
                    pass
            return destroy(group)

        destroy_process_group.__wrapped__ = destroy
        dist.destroy_process_group = destroy_process_group
    except ImportError:
        pass


if os.environ.get("NBOX_RECORD_ONLY") and os.environ.get("NBOX_RECORD"):
    _install(os.environ["NBOX_RECORD"])
_chain_shadowed_sitecustomize()
