"""Receive steering in the cluster's namespaces: each flow's packets stay in order.

A veth (and ``lo``) hands a packet to the receiving side on the CPU that sent it: netif_rx puts
it on that CPU's backlog. A sender that moves between CPUs (the relay, a stub, tbf's watchdog,
any process that is not pinned) then feeds one flow from two backlogs, and packets overtake
each other. TCP takes the reordering for loss: measured on the 2-core machine, 100 Mbit/s and
1 ms through the relay, 250-500 spurious fast retransmits per 20 MiB moved both ways, and a
2 MiB gloo all-reduce at median 220 ms (spread 180-286) against 183 ms once steered. A real
NIC does not reorder a flow, so the emulated link should not either.

RPS fixes it: with ``rps_cpus`` set, the kernel hashes each flow to one CPU's backlog, whichever
CPU sent it. ``rps_cpus`` lives in sysfs, and sysfs shows the network namespace of whoever
mounted it; so a short-lived thread unshares its mount namespace and, per network namespace,
mounts sysfs on a private directory, writes the mask into the chosen receive queues, and unmounts.

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
from typing import Iterable, Sequence

__all__ = ["cpu_mask", "steering", "steer_flows", "rps_masks", "STEER_MAX_RATE"]

CLONE_NEWNS = 0x00020000
CLONE_NEWNET = 0x40000000
MS_REC, MS_PRIVATE = 16384, 1 << 18
MNT_DETACH = 2
STEER_MAX_RATE = 1e9 / 8  # bytes/s: at and below 1 Gbit/s steering only helps (figures above)

_libc = ctypes.CDLL(None, use_errno=True)


def cpu_mask(cpus: set[int] | None = None) -> str:
    """The kernel's bitmap text for a CPU set (32-bit groups, comma-separated), all online CPUs by default."""
    cpus = cpus if cpus is not None else set(range(os.cpu_count() or 1))
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


def steering(links: Iterable[tuple[Sequence[tuple[str, str]], float, float]]) -> dict[str, dict[str, bool]]:
    """Namespace -> {interface: steer it?} for links given as ((ns, ifname) of each end, rate a->b, rate b->a).

    A link is steered when both directions are shaped at most STEER_MAX_RATE (0 is unshaped: as
    fast as the CPU, not steered); ``lo`` of a namespace when all its links are (the relay hands
    its bytes to the local rank over ``lo``).
    """
    out: dict[str, dict[str, bool]] = {}
    for ends, ab, ba in links:
        slow = 0 < ab <= STEER_MAX_RATE and 0 < ba <= STEER_MAX_RATE
        for ns, ifname in ends:
            out.setdefault(ns, {})[ifname] = slow
    for ifs in out.values():
        ifs["lo"] = all(ifs.values())
    return out


def steer_flows(targets: dict[str, dict[str, bool]], mask: str | None = None) -> int:
    """Per namespace path, set ``rps_cpus`` of each named interface to ``mask`` (all CPUs) or to 0; returns how many steer.

    A kernel without RPS has no ``rps_cpus`` file: nothing is set and 0 comes back.
    """
    if not targets:
        return 0
    mask = mask or cpu_mask()

    def write(path: str, sysfs: str) -> int:
        n = 0
        for f in glob.glob(f"{sysfs}/class/net/*/queues/rx-*/rps_cpus"):
            steer = targets[path].get(f.split("/")[-4])
            if steer is None:
                continue
            with contextlib.suppress(OSError), open(f, "w") as fh:
                fh.write(mask if steer else "0")
                n += steer
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
