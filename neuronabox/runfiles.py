"""Temporary folders of a run (``/tmp/nbox-run-*``, ``/tmp/nbox-progress-*``) that outlive no owner.

A folder is made by one process, which holds an exclusive ``flock`` on the folder's ``.owner``
file for as long as it uses it and removes the folder when done. A ``kill -9`` of that process
skips the removal but the kernel drops the lock with the process, so the next folder made with
the same prefix removes every folder of that prefix whose lock it can take: its owner is gone.
A lock, unlike a pid in the name, cannot be fooled by a reused pid. Folders without an ``.owner``
file (made before this module) are left alone: nothing says their owner is gone.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

__all__ = ["owned_tempdir", "remove_abandoned"]

OWNER = ".owner"


def remove_abandoned(prefix: str, root: str | None = None) -> list[Path]:
    """Remove the folders ``<tmp>/<prefix>*`` whose owner has died; returns those removed."""
    removed = []
    for path in Path(root or tempfile.gettempdir()).glob(f"{prefix}*"):
        owner = path / OWNER
        try:
            fd = os.open(owner, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:  # no owner file (not ours, or an older nbox's), or not a folder
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            continue  # its owner runs
        finally:
            os.close(fd)
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


@contextlib.contextmanager
def owned_tempdir(prefix: str) -> Iterator[str]:
    """A new temporary folder, locked by this process while in use, removed after; stale ones of ``prefix`` first."""
    remove_abandoned(prefix)
    path = tempfile.mkdtemp(prefix=prefix)
    # O_CLOEXEC: a child of the run must not inherit (and so keep) the lock after this process dies.
    # Locked under another name, then renamed: a sweep in another process never sees an unlocked .owner.
    fd = os.open(os.path.join(path, OWNER + ".new"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.write(fd, f"{os.getpid()}\n".encode())
        os.rename(os.path.join(path, OWNER + ".new"), os.path.join(path, OWNER))
        yield path
    finally:
        os.close(fd)
        shutil.rmtree(path, ignore_errors=True)
