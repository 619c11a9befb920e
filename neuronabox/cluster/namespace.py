"""Named network namespaces: create, adopt, enter, delete, and the processes inside them.

One kernel concept, after Mininet's node.py: ``Namespace`` is a network namespace bound at
``/run/netns/<name>`` (iproute2's convention, so ``ip netns`` sees ours and we see its). It
is made without forking (``unshare`` in the calling thread, then back), so one process builds
hundreds; a thread enters one with ``entered`` to make sockets that stay there; a child process
is moved into one by ``preexec``, which also binds the namespace's own hosts file over
/etc/hosts so node names resolve. What goes inside (links, addresses, routes) is
``netplan.py``'s plan, built by ``netns.py``.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import socket
import threading
from typing import Iterator

__all__ = ["Namespace", "netns_dir", "list_namespaces", "ns_pids", "remove_namespaces"]

NETNS_DIR = "/run/netns"
# iproute2's convention: `ip netns exec NS` binds the files of /etc/netns/NS over /etc; so do we.
ETC_NETNS = "/etc/netns"
CLONE_NEWNET = 0x40000000
CLONE_NEWNS = 0x00020000
MS_BIND, MS_REC, MS_SHARED, MS_SLAVE = 4096, 16384, 1 << 20, 1 << 19
MNT_DETACH = 2

_libc = ctypes.CDLL(None, use_errno=True)
_ns_lock = threading.RLock()


def netns_dir() -> str:
    """Where named namespaces are bound (iproute2's convention, so `ip netns` sees them)."""
    return NETNS_DIR


def list_namespaces() -> list[str]:
    """Names of every named network namespace on this host."""
    try:
        return sorted(os.listdir(NETNS_DIR))
    except FileNotFoundError:
        return []


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _prepare_rundir() -> None:
    os.makedirs(NETNS_DIR, exist_ok=True)
    # As iproute2 does: the directory must be a shared mount point, or bind mounts made in
    # another mount namespace would not be seen by `ip netns` and friends.
    if _libc.mount(b"", NETNS_DIR.encode(), b"none", MS_SHARED | MS_REC, None) != 0:
        _check(_libc.mount(NETNS_DIR.encode(), NETNS_DIR.encode(), b"none", MS_BIND | MS_REC, None), "bind /run/netns")
        _check(_libc.mount(b"", NETNS_DIR.encode(), b"none", MS_SHARED | MS_REC, None), "share /run/netns")


class Namespace:
    """A named network namespace (``/run/netns/<name>``)."""

    _root_fd: int | None = None

    def __init__(self, name: str):
        self.name = name
        self.path = f"{NETNS_DIR}/{name}"

    @classmethod
    def root_fd(cls) -> int:
        """An fd of the namespace this process started in (to come back to)."""
        if cls._root_fd is None:
            cls._root_fd = os.open("/proc/self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        return cls._root_fd

    def exists(self) -> bool:
        """Whether the namespace is bound."""
        return os.path.exists(self.path)

    def create(self) -> None:
        """Create the namespace and bind it to its path (no fork: unshare in this thread, then return)."""
        root = self.root_fd()
        with _ns_lock:
            _prepare_rundir()
            fd = os.open(self.path, os.O_RDONLY | os.O_CREAT | os.O_EXCL, 0)
            os.close(fd)
            try:
                # unshare(CLONE_NEWNET) moves only the calling thread, which is what lets
                # one process build hundreds of namespaces without forking.
                _check(_libc.unshare(CLONE_NEWNET), f"unshare for {self.name}")
                try:
                    tid = threading.get_native_id()
                    src = f"/proc/self/task/{tid}/ns/net".encode()
                    _check(_libc.mount(src, self.path.encode(), b"none", MS_BIND, None), f"bind {self.path}")
                finally:
                    _check(_libc.setns(root, CLONE_NEWNET), "setns back to the root namespace")
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(self.path)
                raise

    def adopt(self, pid: int) -> None:
        """Bind the network namespace of process ``pid`` (a container's) to this name, as `ip netns attach` does.

        The docker runtime's containers start with no network (Containernet's way); adopted, their
        namespaces take the same plan, veths, qdiscs and relays as namespaces this module creates,
        and ``delete`` unbinds them (the namespace then lives as long as the container does).
        """
        with _ns_lock:
            _prepare_rundir()
            fd = os.open(self.path, os.O_RDONLY | os.O_CREAT | os.O_EXCL, 0)
            os.close(fd)
            try:
                _check(_libc.mount(f"/proc/{pid}/ns/net".encode(), self.path.encode(), b"none", MS_BIND, None),
                       f"bind the namespace of pid {pid} to {self.path}")
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(self.path)
                raise

    @property
    def hosts_file(self) -> str:
        """The namespace's own /etc/hosts (``write_hosts``), bound over /etc/hosts for processes started in it."""
        return f"{ETC_NETNS}/{self.name}/hosts"

    def write_hosts(self, entries: dict[str, str]) -> None:
        """Write the namespace's hosts file: this host's /etc/hosts, then ``entries`` (name -> address)."""
        try:
            with open("/etc/hosts", encoding="utf-8") as f:
                base = f.read()
        except OSError:
            base = "127.0.0.1\tlocalhost\n::1\tlocalhost\n"
        lines = [base.rstrip("\n"), f"# nbox: the nodes of the cluster, for processes in {self.name}"]
        lines += [f"{addr}\t{name}" for name, addr in entries.items()]
        os.makedirs(os.path.dirname(self.hosts_file), exist_ok=True)
        with open(self.hosts_file, "w", encoding="utf-8") as f:
            f.write("\n".join(lines) + "\n")

    def delete(self) -> bool:
        """Unbind and remove the namespace (and its hosts file); False when it did not exist."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.hosts_file)
        with contextlib.suppress(OSError):  # only when empty: a file someone else put there stays
            os.rmdir(os.path.dirname(self.hosts_file))
        if not os.path.exists(self.path):
            return False
        _libc.umount2(self.path.encode(), MNT_DETACH)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        return True

    @contextlib.contextmanager
    def entered(self) -> Iterator[None]:
        """Run the body with this thread inside the namespace (sockets made there stay there)."""
        root = self.root_fd()
        fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        with _ns_lock:
            try:
                _check(_libc.setns(fd, CLONE_NEWNET), f"setns {self.name}")
                yield
            finally:
                os.close(fd)
                _check(_libc.setns(root, CLONE_NEWNET), "setns back to the root namespace")

    def socket(self, *args) -> socket.socket:
        """A socket that lives in this namespace."""
        with self.entered():
            return socket.socket(*args)

    def sysctl(self, values: dict[str, str]) -> None:
        """Set net sysctls inside the namespace (/proc/sys/net follows the thread's namespace)."""
        with self.entered():
            for key, value in values.items():
                with open("/proc/sys/" + key.replace(".", "/"), "w") as f:
                    f.write(value)

    def iproute(self):
        """A pyroute2 IPRoute whose socket lives in this namespace; use it only on the calling thread.

        pyroute2 opens a further socket for every other thread that uses the object, in that
        thread's namespace, so a hand-over would silently act on the wrong namespace.
        """
        from pyroute2 import IPRoute

        with self.entered():
            return IPRoute()

    def inode(self) -> int | None:
        """The namespace's inode (to find the processes inside it)."""
        try:
            return os.stat(self.path).st_ino
        except FileNotFoundError:
            return None

    def preexec(self):
        """A preexec_fn that moves a child process into the namespace."""
        path, hosts = self.path, self.hosts_file.encode()

        def enter() -> None:
            fd = os.open(path, os.O_RDONLY)
            if _libc.setns(fd, CLONE_NEWNET) != 0:
                os._exit(127)
            os.close(fd)
            # As `ip netns exec`: a mount namespace of its own, in which the cluster's hosts file is
            # /etc/hosts, so node names resolve. Without it (no file, no CAP_SYS_ADMIN) the command
            # still runs, with addresses only: better than not running at all.
            if os.path.exists(hosts) and _libc.unshare(CLONE_NEWNS) == 0:
                _libc.mount(b"none", b"/", None, MS_SLAVE | MS_REC, None)  # our binds do not leak out
                _libc.mount(hosts, b"/etc/hosts", b"none", MS_BIND, None)

        return enter


def ns_pids(names: list[str]) -> dict[int, str]:
    """Processes whose network namespace is one of ``names`` (pid -> namespace name)."""
    inodes = {}
    for n in names:
        ino = Namespace(n).inode()
        if ino is not None:
            inodes[ino] = n
    found: dict[int, str] = {}
    if not inodes:
        return found
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            ino = os.stat(f"/proc/{entry}/ns/net").st_ino
        except OSError:
            continue
        if ino in inodes:
            found[int(entry)] = inodes[ino]
    return found



def remove_namespaces(names: list[str]) -> int:
    """Delete the named namespaces that exist; returns how many were removed."""
    return sum(1 for n in names if Namespace(n).delete())
