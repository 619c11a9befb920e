"""The cluster state file: everything ``nbox up`` makes, written down before it is made.

Layout: ``$NBOX_STATE_DIR/<name>/state.json`` (default ``/run/neuronabox`` for root); beside it
``<name>.agent.log``, the agent's log of the last cluster of that name that ``up`` found broken
and removed (why its agent died outlives the cluster). Every write is
the whole document (strict JSON: never NaN or Infinity) to a temporary file, fsync'd, renamed
over the old one and the directory fsync'd, so a reader (``nbox down`` after a crash or a
``kill -9`` of ``up``) sees either the old or the new document, never half of one. Objects are
recorded *before* they are created: an entry whose object never came to exist is harmless to
``down`` (it skips what is missing), whereas an object without an entry would be leaked.

Names. A cluster name is ``[A-Za-z0-9_]{1,24}``; namespaces are ``nbx-<name>-h<i>`` (node i)
and ``nbx-<name>-s<j>`` (switch j). Since a cluster name has no ``-``, two clusters' namespace
names never coincide. Interfaces are only ever created *inside* a cluster's own namespaces
(veth pairs are made in one namespace with the peer placed directly in the other), never in
the root namespace, so their names (``nic0``, ``p3``, ``br0``, at most 15 characters) cannot
collide with another cluster's or the host's.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import time
from pathlib import Path
from typing import Any, Iterator

from ..errors import InputError

__all__ = ["ClusterState", "state_root", "valid_name", "list_clusters", "NAME_RE"]

NAME_RE = re.compile(r"^[A-Za-z0-9_]{1,24}$")
DEFAULT_ROOT = "/run/neuronabox"
# The kinds of objects a state records, in the order `down` removes them.
KINDS = ("processes", "iptables", "qdiscs", "bridges", "veths", "namespaces")


def state_root() -> Path:
    """Where cluster state directories live: $NBOX_STATE_DIR, else /run/neuronabox (root) or a per-user runtime dir."""
    if os.environ.get("NBOX_STATE_DIR"):
        return Path(os.environ["NBOX_STATE_DIR"])
    if os.geteuid() == 0:
        return Path(DEFAULT_ROOT)
    # An unprivileged user (the local runtime) cannot write /run.
    base = os.environ.get("XDG_RUNTIME_DIR") or f"/tmp/neuronabox-{os.getuid()}"
    return Path(base) / "neuronabox" if os.environ.get("XDG_RUNTIME_DIR") else Path(base)


def valid_name(name: str) -> str:
    """Check a cluster name (letters, digits, underscore; at most 24) and return it."""
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise InputError(f"--name: a cluster name is 1-24 letters, digits or '_', got {name!r}")
    return name


def default_name(topology_name: str) -> str:
    """A cluster name derived from a topology name."""
    cleaned = re.sub(r"[^A-Za-z0-9_]", "_", topology_name or "cluster")[:24]
    return cleaned or "cluster"


def list_clusters() -> list[str]:
    """Names of the clusters that have a state file."""
    root = state_root()
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir() if (p / "state.json").is_file() and NAME_RE.match(p.name))


class ClusterState:
    """One cluster's state document, with write-ahead recording of every object."""

    def __init__(self, name: str, data: dict[str, Any] | None = None):
        self.name = valid_name(name)
        self.dir = state_root() / name
        self.path = self.dir / "state.json"
        self.data: dict[str, Any] = data if data is not None else {
            "name": name,
            "version": 1,
            "phase": "new",
            "created": time.time(),
            **{k: [] for k in KINDS},
        }

    # ---- loading and saving ---------------------------------------------------------------
    @classmethod
    def load(cls, name: str) -> "ClusterState":
        """The state of cluster ``name``; InputError when there is none."""
        st = cls(name)
        try:
            st.data = json.loads(st.path.read_text())
        except FileNotFoundError:
            raise InputError(f"no cluster named {name!r} (no {st.path})") from None
        except json.JSONDecodeError as exc:
            raise InputError(f"{st.path}: not a valid state file ({exc})") from None
        for k in KINDS:
            st.data.setdefault(k, [])
        return st

    @classmethod
    def exists(cls, name: str) -> bool:
        """Whether cluster ``name`` has a state file."""
        return (state_root() / valid_name(name) / "state.json").is_file()

    def save(self) -> None:
        """Write the document atomically and durably (tmp file, fsync, rename, fsync dir)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        tmp = self.dir / f".state.{os.getpid()}.tmp"
        # allow_nan=False: NaN and Infinity are not JSON; a state holding one is refused here
        # (ValueError), before it is written, rather than left for every later reader to fail on.
        body = json.dumps(self.data, separators=(",", ":"), sort_keys=True, allow_nan=False).encode()
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, body)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, self.path)
        dfd = os.open(self.dir, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)

    @contextlib.contextmanager
    def locked(self, blocking: bool = True) -> Iterator["ClusterState"]:
        """Hold the cluster's lock (up, down and the agent all write the same file); reloads on entry.

        ``blocking=False``: raise BlockingIOError at once when another process holds it.
        """
        while True:
            self.dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.dir / "lock", os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
            except BlockingIOError:
                os.close(fd)
                raise
            # A `down` that held the lock meanwhile removed the file: this lock then guards
            # nothing (a newcomer locks a new file), so take the one that is there now.
            try:
                current = os.stat(self.dir / "lock").st_ino
            except FileNotFoundError:
                current = None
            if current == os.fstat(fd).st_ino:
                break
            os.close(fd)
        try:
            if self.path.exists():
                fresh = json.loads(self.path.read_text())
                for k in KINDS:
                    fresh.setdefault(k, [])
                self.data = fresh
            yield self
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    # ---- write-ahead recording -------------------------------------------------------------
    def record(self, kind: str, items: list[dict[str, Any]] | dict[str, Any]) -> None:
        """Append objects of one kind and save, before the caller creates them."""
        if kind not in KINDS:
            raise ValueError(f"unknown state kind {kind!r}")
        if isinstance(items, dict):
            items = [items]
        self.data[kind].extend(items)
        self.save()

    def update_process(self, token: str, **fields: Any) -> None:
        """Fill in what is known only after a process started (pid, start time)."""
        for p in self.data["processes"]:
            if p.get("token") == token:
                p.update(fields)
        self.save()

    def set(self, **fields: Any) -> None:
        """Set top-level fields and save."""
        self.data.update(fields)
        self.save()

    def remove_files(self, keep_lock: bool = False) -> None:
        """Delete the state directory once everything it names is gone (``keep_lock``: a holder goes on)."""
        for p in (self.path, *(() if keep_lock else (self.dir / "lock",)), *self.dir.glob(".state.*.tmp"), *self.dir.glob("*.sock"), *self.dir.glob("*.log"), *self.dir.glob("*.json")):
            with contextlib.suppress(FileNotFoundError):
                p.unlink()
        with contextlib.suppress(OSError):
            self.dir.rmdir()

    def __getitem__(self, key: str) -> Any:
        return self.data[key]

    def get(self, key: str, default: Any = None) -> Any:
        """A top-level field."""
        return self.data.get(key, default)
