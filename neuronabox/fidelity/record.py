"""``nbox record``: a real testbed's own run, recorded for ``nbox validate --against``.

The paper's validation compares real nodes with emulated ones. ``nbox record -o DIR --
LAUNCHER ...`` runs the launcher (torchrun on each lab machine, an srun step, or a plain
``python train.py`` with the torch.distributed environment set) with the real backend
untouched: the record-only ``sitecustomize`` (``recordonly/``, the one ``nbox validate`` uses
for its real system) marks the iterations of every rank the launcher starts and writes
``DIR/rank-<rank>.json`` at its exit. Gather the folders of all machines (or record into a shared
one); ``nbox validate TOPOLOGY --against DIR... -- cmd`` then reads the recorded rank's
iterations as the real system, one folder per run, and runs only the emulated side here.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

from ..errors import InputError
from .real_system import RECORD_ONLY_DIR

__all__ = ["run_record", "load_against"]


def run_record(command: Sequence[str], out: Path) -> tuple[int, list[Path]]:
    """Run ``command`` recording every rank it starts into ``out``; its exit status and the rank files written."""
    from ..emu.environ import child_pythonpath

    if not command:
        raise InputError("nbox record: no command to run (usage: nbox record -o DIR -- torchrun ... train.py)")
    out.mkdir(parents=True, exist_ok=True)
    manifest = {"command": list(command), "host": socket.gethostname(), "started": time.time(), "cwd": os.getcwd()}
    # Several machines may record into one shared folder: one manifest per host.
    (out / f"record-{socket.gethostname()}.json").write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if not k.startswith("NBOX_")}
    env.update({
        "PYTHONPATH": child_pythonpath(RECORD_ONLY_DIR), "NBOX_RECORD_ONLY": "1",
        "NBOX_RECORD": str(out.resolve() / "rank-{rank}.json"),
    })
    try:
        rc = subprocess.call(list(command), env=env)
    except FileNotFoundError:
        raise InputError(f"command not found: {command[0]!r}") from None
    # This run's files: new ones and ones it wrote over (a folder may hold an earlier run's).
    written = sorted(p for p in out.glob("rank-*.json") if p.stat().st_mtime >= manifest["started"])
    return rc, written


def load_against(folders: Sequence[Path], rank: int, world_size: int) -> list[list[float]]:
    """Each folder's iterations of ``rank`` (one run each); a folder without that rank, or of another world, is refused."""
    runs = []
    for folder in folders:
        folder = Path(folder)
        path = folder / f"rank-{rank}.json" if folder.is_dir() else folder
        if not path.exists():
            found = sorted(p.name for p in folder.glob("rank-*.json")) if folder.is_dir() else []
            raise InputError(f"{folder}: no record of rank {rank} (has: {', '.join(found) or 'nothing recorded'}); "
                             "record it with nbox record, or validate another --rank")
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            iterations = [float(x) for x in data["iterations"]]
            world = int(data["world_size"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise InputError(f"{path}: not an nbox record ({exc.__class__.__name__}: {exc})") from None
        if world != world_size:
            raise InputError(f"{path}: recorded a world of {world} ranks, the topology has {world_size}")
        runs.append(iterations)
    return runs


def main_note() -> str:
    """The line ``nbox record`` prints when nothing was recorded."""
    return (f"no rank recorded: the command made no optimizer step under torch ({sys.executable} runs the "
            "record-only hook only in Python processes that inherit this environment)")
