"""The ``nbox`` command: parses arguments, calls one function per verb, prints.

Exit codes: 0 success, 1 the run failed, 2 bad usage or bad input (one line naming the file,
the YAML path and the value; a traceback only with ``--debug``). Each verb family lives in its
own module and registers itself on ``app``.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import typer
from rich.console import Console

from ..errors import NboxError

app = typer.Typer(
    name="nbox",
    help="NeuronaBox: emulate distributed DNN training on one node.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
# Piped into a file or a CI log, rich assumes 80 columns and folds the wider tables (validate's
# verdicts, show's node lists) into narrow columns; a terminal or COLUMNS still decides.
PIPED_WIDTH = 120
console = Console(width=None if sys.stdout.isatty() or "COLUMNS" in os.environ else PIPED_WIDTH)
_state = {"debug": False}


@app.callback()
def _root(debug: bool = typer.Option(False, "--debug", help="Show tracebacks on errors.")) -> None:
    _state["debug"] = debug


def load(path: Path, inject=(), latency_scale=None, bandwidth_scale=None, stragglers=(), world_size=None):
    """Load a topology file and merge command-line what-if knobs over it."""
    from ..topology import load_topology
    from ..topology.whatif import apply_whatif_flags

    topo = load_topology(path)
    return apply_whatif_flags(topo, inject, latency_scale, bandwidth_scale, stragglers, world_size)


INJECT = typer.Option([], "--inject", help="Extra latency per collective, e.g. all_reduce=+2ms (repeatable).")
LATENCY_SCALE = typer.Option(None, "--latency-scale", help="Multiply every latency.")
BANDWIDTH_SCALE = typer.Option(None, "--bandwidth-scale", help="Multiply every network bandwidth.")
WORLD_SIZE = typer.Option(None, "--world-size", help="Grow or shrink the cluster to this many ranks.")

# Verb modules register their commands on `app` when imported.
from . import cluster_cmds, compose_cmds, fidelity_cmds, model_cmds, report_cmds, run_cmd  # noqa: E402,F401
from . import deploy_cmds, image_cmds, profile_cmd  # noqa: E402,F401


# Signals that end nbox the way the default action would, but through every ``finally``.
_LEAVE_ON = (signal.SIGTERM, signal.SIGHUP)


def _leave_on_signal(signum, frame) -> None:
    """SIGTERM or SIGHUP: exit with 128 + the signal, through every ``finally`` and context manager."""
    # Killed outright, a calibrate or validate left its cluster up (agent, relays, stubs, a
    # namespace per node) and its ranks running; on the way out they are taken down as after
    # an error. A second signal must not cut that clean-up short.
    for s in _LEAVE_ON:
        signal.signal(s, _while_leaving)
    _state["signal"] = signal.Signals(signum).name
    raise SystemExit(128 + signum)


def _while_leaving(signum, frame) -> None:
    """A signal while nbox cleans up after the first: ignored, the clean-up finishes."""


def _install_signal_exits() -> None:
    import threading

    if threading.current_thread() is not threading.main_thread():
        return
    for s in _LEAVE_ON:
        # A signal someone ignores on purpose (nohup's SIGHUP) stays ignored.
        if signal.getsignal(s) is signal.SIG_DFL:
            signal.signal(s, _leave_on_signal)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``nbox`` console script."""
    _install_signal_exits()
    try:
        # Standalone mode: click prints usage errors itself and exits 2; our errors are not
        # click's exceptions, so they come through here.
        app(args=argv, prog_name="nbox")
    except NboxError as exc:
        if _state["debug"]:
            raise
        print(f"nbox: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except SystemExit as exc:
        if _state.get("signal"):
            print(f"nbox: stopped by {_state['signal']}", file=sys.stderr)
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    return 0
