"""Receive steering in the cluster's namespaces: each flow's packets stay in order.

A veth (and ``lo``) hands a packet to the receiving side on the CPU that sent it: netif_rx puts
it on that CPU's backlog. A sender that moves between CPUs (the relay, a stub, tbf's watchdog,
any process that is not pinned) then feeds one flow from two backlogs, and packets overtake
each other. TCP takes the reordering for loss: measured on the 2-core machine, 100 Mbit/s and
1 ms through the relay, 250-500 spurious fast retransmits per 20 MiB moved both ways, and a
2 MiB gloo all-reduce at median 220 ms (spread 180-286) against 183 ms once steered. A real
NIC does not reorder a flow, so the emulated link should not either.

RPS fixes it: with ``rps_cpus`` set, the kernel queues each flow on one CPU's backlog (of those
in the mask), whichever CPU sent it; a node's interfaces are steered to the node's own CPU, the
one its rank is pinned to, as a real node's NIC interrupts its own cores. ``rps_cpus`` lives in
sysfs, and sysfs shows the network namespace of whoever mounted it; so a short-lived thread
unshares its mount namespace and, per network namespace, mounts sysfs on a private directory,
writes the mask into the chosen receive queues, and unmounts.

Steering has a price: every packet of a flow is processed on one CPU (and a connection's two
directions hash alike), which costs where the CPU, not the link, is the bottleneck. Measured
(2 MiB and 16 MiB gloo all-reduce, 2 ranks, medians): 100 Mbit/s 220 -> 183 ms; 1 Gbit/s 17.8
vs 17.8 ms and 142-146 ms either way; 10 Gbit/s (the relay tops out near 4-6 Gbit/s here)
4.2 -> 10.8 ms and 31 -> 38 ms. So links above ``STEER_MAX_RATE`` are left as they are.
"""

from __future__ import annotations

import contextlib
import ctypes
import glob
import os
import tempfile
import threading
from typing import Callable, Iterable, Sequence

__all__ = ["cpu_mask", "node_cpu", "node_home", "steering", "steer_flows", "rps_masks", "STEER_MAX_RATE"]

CLONE_NEWNS = 0x00020000
CLONE_NEWNET = 0x40000000
MS_REC, MS_PRIVATE = 16384, 1 << 18
MNT_DETACH = 2
STEER_MAX_RATE = 1e9 / 8  # bytes/s: at and below 1 Gbit/s steering only helps (figures above)

_libc = ctypes.CDLL(None, use_errno=True)


def cpu_mask(cpus: set[int] | None = None) -> str:
    """The kernel's bitmap text for a CPU set (32-bit groups, comma-separated), all online CPUs by default."""
    cpus = cpus if cpus is not None else _all_cpus()
    bits = sum(1 << c for c in cpus)
    groups = []
    while True:
        groups.append(f"{bits & 0xFFFFFFFF:08x}")
        bits >>= 32
        if not bits:
            break
    return ",".join(reversed(groups))


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _in_private_mounts(work, paths: list[str]):
    """Run ``work(ns_path, sysfs_dir)`` for each namespace path on a thread with its own mount namespace."""
    out: dict[str, object] = {}
    failure: list[BaseException] = []

    def body() -> None:
        try:
            # Only this thread's view changes (CLONE_NEWNS unshares the thread's fs too), and
            # private propagation keeps its sysfs mounts from showing up anywhere else.
            _check(_libc.unshare(CLONE_NEWNS), "unshare mount namespace")
            _check(_libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None), "make / private")
            with tempfile.TemporaryDirectory(prefix="nbox-sysfs-") as mnt:
                for path in paths:
                    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
                    try:
                        _check(_libc.setns(fd, CLONE_NEWNET), f"setns {path}")
                    finally:
                        os.close(fd)
                    _check(_libc.mount(b"sysfs", mnt.encode(), b"sysfs", 0, None), f"mount sysfs for {path}")
                    try:
                        out[path] = work(path, mnt)
                    finally:
                        _libc.umount2(mnt.encode(), MNT_DETACH)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
            failure.append(exc)

    # A fresh thread: its namespaces (mount and net) die with it, the caller's stay untouched.
    t = threading.Thread(target=body, name="nbox-steering", daemon=True)
    t.start()
    t.join()
    if failure:
        raise failure[0]
    return out


def node_cpu(index: int) -> int:
    """The CPU that does node ``index``'s receive work: the k-th usable CPU, round robin (validate pins rank k there)."""
    cpus = sorted(os.sched_getaffinity(0))
    return cpus[index % len(cpus)]


def node_home(ns: str) -> int | None:
    """The CPU of the node whose namespace is ``ns`` (None for a switch or a foreign namespace)."""
    from .netplan import ns_role

    role = ns_role(ns)
    return node_cpu(role[1]) if role and role[0] == "h" else None


def steering(links: Iterable[tuple[Sequence[tuple[str, str]], float, float]],
             home: Callable[[str], int | None] = node_home) -> dict[str, dict[str, str]]:
    """Namespace -> {interface: ``rps_cpus`` mask, "0" for not steered} for links given as ((ns, ifname) of each end, rate a->b, rate b->a).

    A link is steered when both directions are shaped at most STEER_MAX_RATE (0 is unshaped: as
    fast as the CPU, not steered); ``lo`` of a namespace when all its links are (the relay hands
    its bytes to the local rank over ``lo``). Steered to one CPU, not hashed over all: a node's
    interfaces to the node's CPU (``home``: node k -> ``node_cpu(k)``), a switch port to its
    peer node's CPU (the node's packets are received where it sends them); a port between two
    switches, and a namespace without a home (a container's path), hash over all CPUs. Hashing
    put each connection's receive work on a core chosen by its port numbers, so which rank lost CPU to
    it changed with every process group, and with it the result of a whole fidelity run (wire
    mode's 100 Mbit/s CNN moved 5 % between cluster instances).
    """
    steered: dict[str, dict[str, set[int] | None]] = {}
    for ends, ab, ba in links:
        slow = 0 < ab <= STEER_MAX_RATE and 0 < ba <= STEER_MAX_RATE
        homes = [home(ns) for ns, _ in ends]
        for i, (ns, ifname) in enumerate(ends):
            if not slow:
                steered.setdefault(ns, {})[ifname] = None
                continue
            mine = homes[i] if homes[i] is not None else (homes[1 - i] if len(ends) == 2 else None)
            steered.setdefault(ns, {})[ifname] = {mine} if mine is not None else _all_cpus()
    out: dict[str, dict[str, str]] = {}
    for ns, ifs in steered.items():
        lo: set[int] | None = None
        if all(v is not None for v in ifs.values()):
            own = home(ns)
            lo = {own} if own is not None else set().union(*ifs.values())
        out[ns] = {ifname: cpu_mask(v) if v else "0" for ifname, v in ifs.items()}
        out[ns]["lo"] = cpu_mask(lo) if lo else "0"
    return out


def _all_cpus() -> set[int]:
    return set(range(os.cpu_count() or 1))


def steer_flows(targets: dict[str, dict[str, str]]) -> int:
    """Per namespace path, set ``rps_cpus`` of each named interface to its mask ("0": not steered); returns how many steer.

    A kernel without RPS has no ``rps_cpus`` file: nothing is set and 0 comes back.
    """
    if not targets:
        return 0

    def write(path: str, sysfs: str) -> int:
        n = 0
        for f in glob.glob(f"{sysfs}/class/net/*/queues/rx-*/rps_cpus"):
            mask = targets[path].get(f.split("/")[-4])
            if mask is None:
                continue
            with contextlib.suppress(OSError), open(f, "w") as fh:
                fh.write(mask)
                n += mask.strip("0,") != ""
        return n

    return sum(_in_private_mounts(write, list(targets)).values())


def rps_masks(ns_path: str) -> dict[str, str]:
    """Interface/queue -> ``rps_cpus`` inside one namespace (what ``steer_flows`` set; for checks)."""

    def read(_path: str, sysfs: str) -> dict[str, str]:
        masks = {}
        for f in sorted(glob.glob(f"{sysfs}/class/net/*/queues/rx-*/rps_cpus")):
            parts = f.split("/")
            with open(f) as fh:
                masks[f"{parts[-4]}/{parts[-2]}"] = fh.read().strip()
        return masks

    return _in_private_mounts(read, [ns_path])[ns_path]
