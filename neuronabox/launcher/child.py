"""The child side of ``nbox run``: what a process of the run does at start-up, before the user's code.

``sitecustomize`` (``neuronabox/launcher/autostart``, first on the child's PYTHONPATH) calls
``autostart``: once the process imports torch, the nbox backend is installed
(``neuronabox.emu.launch.install``) and the metrics exporter and progress file start when the
environment asks for them; at exit, on SIGTERM and on Ctrl-C the recorder is written to
``NBOX_RECORD`` as JSON, which the parent reads for its summary. ``python -m
neuronabox.launcher.child SCRIPT`` does the same for one script without ``sitecustomize``.
"""

from __future__ import annotations

import os

import wrapt

from ..emu.launch import install
from ..emu.wire_env import ENV_WIRE, use_stubs

__all__ = ["autostart", "run_script"]


def run_script(argv: list[str]) -> None:
    """Run ``argv[0]`` (a script path, or ``-m module``) as ``__main__`` with the nbox backend installed.

    The child side of ``nbox run``: the parent sets ``prepare_env(...)`` plus ``NBOX_TOPOLOGY``
    (and optionally ``NBOX_MODEL``); if ``NBOX_RECORD`` names a file, the recorder is written
    there as JSON when the script ends, even by an exception or ``sys.exit``.
    """
    import runpy
    import sys

    if not argv:
        raise SystemExit("usage: python -m neuronabox.launcher.child SCRIPT [ARGS...] | -m MODULE [ARGS...]")
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
    if os.environ.get(ENV_WIRE):
        # Wire mode: the emulator finds the cluster's stubs through the cluster's own lookup.
        from ..cluster.stub import stub_locator

        use_stubs(stub_locator)
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
        emulator = sys.modules.get("neuronabox.emu.emulator")  # not imported: this process emulates nothing
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

    from ..emu import emulator

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
    inner = getattr(emu.model, "inner", emu.model)
    if getattr(inner, "hardware_source", ""):  # the nccl model: which hardware profile timed the run, and its error
        notes = getattr(inner, "accuracy_notes", None)  # a plug-in model may name a source and have no notes
        data["hardware"] = [inner.hardware_source, *(notes() if notes else ())]
    if emu.nccl_env:  # NCCL_ALGO and the like, read from the script's environment
        data["nccl_env"] = emu.nccl_env
    effects = getattr(emu, "effects", ())
    if effects:  # what the host effects did in this run, one line each (host_effects/)
        data["host_effects"] = [e.describe() for e in effects]
    if emu.replay is not None:
        data["roles"] = emu.replay.summary(rec.t0)
        data["roles"]["_real"] = {"rank": emu.real_rank, "role": emu.replay.roles.role_of(emu.real_rank)}
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f)


if __name__ == "__main__":
    import sys

    # Use the package's copy of this module, as the rest of nbox sees it.
    from neuronabox.launcher.child import run_script as _run_script

    _run_script(sys.argv[1:])
