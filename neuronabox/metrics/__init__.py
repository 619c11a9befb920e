"""Metrics: the real rank's Prometheus exporter, scrape configuration, live progress.

``start_from_env()`` is what a process started by ``nbox run`` calls at start-up
(``neuronabox.launcher.child.autostart``): it starts the exporter when ``NBOX_METRICS_ADDR`` is
set and the progress writer when ``NBOX_PROGRESS_FILE`` is set, and does nothing otherwise.
"""

from __future__ import annotations

import atexit
import os
import sys

__all__ = [
    "start_from_env",
    "start_exporter",
    "Exporter",
    "ENV_ADDR",
    "ENV_FILE",
    "ENV_CLUSTER",
    "ENV_RUN",
    "ENV_LINGER",
    "ENV_PORT",
    "ENV_PROGRESS",
]

# The names are repeated here (not imported) so that a run without metrics never imports
# prometheus_client: every `nbox run` child calls start_from_env at start-up.
ENV_ADDR = "NBOX_METRICS_ADDR"
ENV_FILE = "NBOX_METRICS_FILE"
ENV_CLUSTER = "NBOX_CLUSTER"
ENV_RUN = "NBOX_RUN"
ENV_LINGER = "NBOX_METRICS_LINGER"
ENV_PORT = "NBOX_METRICS_PORT"
ENV_PROGRESS = "NBOX_PROGRESS_FILE"
_OWNER = "NBOX_METRICS_OWNER"
_started: dict[str, object] = {}


def __getattr__(name: str):
    if name in ("Exporter", "start_exporter"):
        from . import exporter

        return getattr(exporter, name)
    raise AttributeError(name)


def start_from_env():
    """Start the exporter and the progress writer that the environment asks for (idempotent); returns the exporter."""
    if "exporter" in _started or "writer" in _started:
        return _started.get("exporter")  # type: ignore[return-value]
    owner = os.environ.get(_OWNER)
    if owner and owner != str(os.getpid()):
        # A Python child of the real rank (a spawned DataLoader worker runs sitecustomize too):
        # the real rank already exports, and a second exporter would fight for the port or file.
        return None
    exp = None
    port = os.environ.get(ENV_PORT)
    addr = os.environ.get(ENV_ADDR) or ("127.0.0.1" if port else None)
    if addr:
        from .exporter import DEFAULT_PORT, start_exporter

        try:
            default_port = int(port) if port else DEFAULT_PORT
            exp = start_exporter(addr, address_file=os.environ.get(ENV_FILE) or None, default_port=default_port)
        except (OSError, ValueError) as exc:
            # Metrics are an observer: a taken port must not stop the training run.
            sys.stderr.write(f"nbox: metrics exporter not started on {addr!r}: {exc}\n")
        else:
            _started["exporter"] = exp
            linger = _float(os.environ.get(ENV_LINGER), 0.0)
            atexit.register(exp.close, linger)
    progress = os.environ.get(ENV_PROGRESS)
    if progress:
        from .progress import ProgressWriter

        writer = ProgressWriter(progress).start()
        _started["writer"] = writer
        atexit.register(writer.stop)
    if _started:
        os.environ[_OWNER] = str(os.getpid())
    return exp


def _float(text: str | None, default: float) -> float:
    try:
        return float(text) if text else default
    except ValueError:
        return default
