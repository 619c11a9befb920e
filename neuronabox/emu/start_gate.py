"""The start gate: processes launched side by side run their training steps side by side.

``nbox validate`` runs the load twin (the real system's other ranks, each its own model-mode
``nbox run``) beside every emulated run. Launched together they still reached their steps
apart: on the 2-core machine a process's start-up (imports) varied by up to 0.75 s, and a
wire-mode rank connects to its stub peers during its first iteration, so a twin ran ahead,
ended first and left the measured rank's last steps to an idle machine, or lagged behind.

Two meeting points, both inside the warm-up:

- when its first process group is created, every process waits until all of them are there,
  as gloo's rendezvous makes the real system's ranks wait for each other;
- at the end of its first iteration, the measured rank (``NBOX_START_LEAD``) opens the gate
  and the twins wait there for it: the measured rank never waits for a twin's iteration.

``NBOX_START_GATE`` names a fresh directory the processes share, ``NBOX_START_PARTIES`` how
many they are. Without them nothing happens. The launcher creates ``abandoned`` in it when one
of them ended early: nobody waits for it any longer.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

ENV_GATE = "NBOX_START_GATE"
ENV_PARTIES = "NBOX_START_PARTIES"
ENV_LEAD = "NBOX_START_LEAD"
# A process whose partners died before meeting it goes on alone after this long (validate ends
# the twins when the measured rank has ended).
WAIT_LIMIT_S = 120.0
# Looking at a directory this often costs nothing measurable and keeps the meeting within a few
# milliseconds.
POLL_S = 0.005
OPEN = "open"
ABANDONED = "abandoned"

_met = False


def _gate() -> Path | None:
    path = os.environ.get(ENV_GATE)
    return Path(path) if path else None


def _wait_for(gate: Path, ready) -> None:
    deadline = time.monotonic() + WAIT_LIMIT_S
    while not ready() and not (gate / ABANDONED).exists() and time.monotonic() < deadline:
        time.sleep(POLL_S)


def rendezvous() -> None:
    """Wait until every process of the gate has created its first process group (only the first call acts)."""
    global _met
    gate = _gate()
    if gate is None or _met:
        return
    _met = True
    parties = int(os.environ.get(ENV_PARTIES, "1"))
    gate.mkdir(parents=True, exist_ok=True)
    (gate / f"{os.getpid()}.ready").touch()
    _wait_for(gate, lambda: sum(1 for p in gate.iterdir() if p.suffix == ".ready") >= parties)


def install(recorder) -> None:
    """Meet at the gate (if the environment names one) at the recorder's first iteration mark."""
    if _gate() is not None:
        recorder.iteration_listeners.append(_at_iteration)


def _at_iteration(index: int) -> None:
    if index != 0:
        return
    gate = _gate()
    if os.environ.get(ENV_LEAD):
        (gate / OPEN).touch()
    else:
        _wait_for(gate, (gate / OPEN).exists)
