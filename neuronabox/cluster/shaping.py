"""Link shaping, every tc parameter in one place (Mininet's link.py plays this role there).

Per link direction (the egress qdisc of the sending veth end):

- rate: ``tbf`` (default) or ``htb`` (also used above tbf's 32-bit bytes/s field, 34 Gbit/s);
- delay, jitter: ``netem`` under the rate qdisc when the kernel has it; otherwise the
  user-space TCP relay of the shaping agent (``relay.py``) adds them to TCP streams;
- loss: ``netem`` when present; otherwise an iptables ``statistic`` DROP rule at the link's
  routed end (a bridge port is not seen by iptables, but every link has a routed end: its
  NIC, or both ends of a switch-to-switch link).

``mechanisms()`` says which of these each link uses; ``nbox up`` and ``nbox doctor`` print it.
"""

from __future__ import annotations

import errno
import functools
import socket
import struct
import subprocess
from dataclasses import asdict, dataclass

from .netns import Namespace

__all__ = [
    "LinkShape",
    "RateParams",
    "rate_params",
    "kernel_qdiscs",
    "has_netem",
    "apply_rate",
    "apply_loss",
    "mechanisms",
    "QDISCS",
]

MTU_FRAME = 1514
# The qdiscs `nbox doctor` asks the kernel about.
QDISCS = ("netem", "tbf", "htb", "pfifo", "fq", "fq_codel", "sfq", "prio", "cake", "ingress", "clsact")
TBF_MAX_RATE = (1 << 32) - 1  # bytes/s: tbf's rate field (pyroute2 sends no TCA_TBF_RATE64)
LOSS_CHAIN = "NBOX_LOSS"


@dataclass
class LinkShape:
    """What one link direction should look like: rate (bytes/s, 0 = unshaped), delay, jitter (s), loss (0-1)."""

    rate: float = 0.0
    delay: float = 0.0
    jitter: float = 0.0
    loss: float = 0.0

    def as_dict(self) -> dict:
        """JSON form."""
        return asdict(self)


@dataclass(frozen=True)
class RateParams:
    """tbf/htb numbers for one rate."""

    rate: int  # bytes/s
    burst: int  # bytes the bucket holds
    limit: int  # bytes the queue holds (tbf)


def rate_params(rate: float) -> RateParams:
    """Bucket and queue sizes for a rate between 1 Mbit/s and 100 Gbit/s.

    Burst: one timer tick's worth (1 ms, as tc-tbf(8) asks: at least rate/HZ) but never under
    two full frames, or tbf could not pass a frame at low rates. Queue: 20 ms of traffic plus
    the burst, at least ten frames, so that TCP keeps the link busy without a bloated queue.
    """
    r = int(rate)
    burst = max(2 * MTU_FRAME, int(r * 0.001))
    limit = burst + max(10 * MTU_FRAME, int(r * 0.020))
    return RateParams(r, burst, limit)


# ---- what the kernel has ---------------------------------------------------------------------
RTM_NEWQDISC = 36
TCA_KIND = 1
TC_H_ROOT, TC_H_INGRESS = 0xFFFFFFFF, 0xFFFFFFF1


def _probe_qdisc(sock: socket.socket, kind: str, seq: int) -> bool:
    parent = TC_H_INGRESS if kind in ("ingress", "clsact") else TC_H_ROOT
    handle = 0xFFFF0000 if kind in ("ingress", "clsact") else 0
    kattr = kind.encode() + b"\0"
    n = 4 + len(kattr)
    body = struct.pack("=BxxxiIII", socket.AF_UNSPEC, 1, handle, parent, 0)
    body += struct.pack("=HH", n, TCA_KIND) + kattr + b"\0" * ((4 - n % 4) % 4)
    hdr = struct.pack("=IHHII", 16 + len(body), RTM_NEWQDISC, 0x1 | 0x4 | 0x400 | 0x100, seq, 0)
    sock.send(hdr + body)
    data = sock.recv(65536)
    (code,) = struct.unpack_from("=i", data, 16)
    # ENOENT is the kernel's "Specified qdisc kind is unknown"; a present qdisc either takes the
    # bare request or rejects its missing options (EINVAL), which still proves it exists.
    return code != -errno.ENOENT


@functools.lru_cache(maxsize=1)
def kernel_qdiscs() -> dict[str, bool]:
    """Which qdiscs this kernel has, probed on ``lo`` of a scratch namespace."""
    import os

    ns = Namespace(f"nbx-probe-{os.getpid()}")
    ns.create()
    try:
        sock = ns.socket(socket.AF_NETLINK, socket.SOCK_RAW, 0)
        sock.bind((0, 0))
        with sock:
            return {k: _probe_qdisc(sock, k, i + 1) for i, k in enumerate(QDISCS)}
    finally:
        ns.delete()


def has_netem() -> bool:
    """Whether the kernel has sch_netem (absent on this project's machines)."""
    try:
        return kernel_qdiscs()["netem"]
    except OSError:
        return False


# ---- applying --------------------------------------------------------------------------------
def apply_rate(ipr, index: int, shape: LinkShape, kind: str = "tbf", change: bool = False, netem: bool = False) -> str:
    """Install (or change in place) the egress qdiscs of one link end; returns the rate mechanism."""
    cmd = "change" if change else "add"
    with_netem = netem and (shape.delay > 0 or shape.jitter > 0 or shape.loss > 0)
    if shape.rate <= 0 and not with_netem:
        if change:
            _delete_root(ipr, index)
        return "none"
    parent = 0xFFFFFFFF
    if with_netem:
        ipr.tc(cmd, "netem", index, 0x10000, delay=int(shape.delay * 1e6), jitter=int(shape.jitter * 1e6),
               loss=shape.loss * 100, limit=10000)
        parent = 0x10001
        if shape.rate <= 0:
            return "none"
    p = rate_params(shape.rate)
    if kind == "tbf" and p.rate > TBF_MAX_RATE:
        kind = "htb"
    handle = 0x20000 if with_netem else 0x10000
    if kind == "tbf":
        ipr.tc(cmd, "tbf", index, handle, parent=parent, rate=p.rate, burst=p.burst, limit=p.limit)
    else:
        if not change:
            ipr.tc("add", "htb", index, handle, parent=parent, default=1)
        ipr.tc(cmd + "-class" if cmd == "add" else "change-class", "htb", index, handle | 1, parent=handle,
               rate=p.rate, ceil=p.rate, burst=p.burst, cburst=p.burst)
    return kind


def _delete_root(ipr, index: int) -> None:
    try:
        ipr.tc("del", index=index)
    except Exception:  # noqa: BLE001 - no root qdisc to delete is the goal already reached
        pass


def iptables(ns: Namespace | None, args: list[str], check: bool = True) -> subprocess.CompletedProcess:
    """Run the iptables binary (there is no netlink API for it) inside ``ns``."""
    return subprocess.run(
        ["iptables", "-w", *args], capture_output=True, text=True, check=check,
        preexec_fn=ns.preexec() if ns else None,
    )


def iptables_parallel(jobs: list[tuple[Namespace, list[str]]], width: int = 8) -> None:
    """Run independent iptables calls (one namespace each) a few at a time; each costs ~15 ms of process start."""
    running: list[tuple[subprocess.Popen, list[str]]] = []

    def reap(p: subprocess.Popen, args: list[str]) -> None:
        _, err = p.communicate()
        if p.returncode != 0:
            raise subprocess.CalledProcessError(p.returncode, ["iptables", *args], stderr=err)

    for ns, args in jobs:
        if len(running) >= width:
            reap(*running.pop(0))
        p = subprocess.Popen(["iptables", "-w", *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                             preexec_fn=ns.preexec())
        running.append((p, args))
    for p, args in running:
        reap(p, args)


def loss_rules(link, loss_ab: float, loss_ba: float) -> dict[str, list[list[str]]]:
    """iptables rules (per namespace) that drop a fraction of each direction of ``link``."""
    out: dict[str, list[list[str]]] = {}
    for src, dst, p in ((link.a, link.b, loss_ab), (link.b, link.a, loss_ba)):
        if p <= 0:
            continue
        stat = ["-m", "statistic", "--mode", "random", "--probability", f"{min(p, 1.0):.6f}", "-j", "DROP",
                "-m", "comment", "--comment", f"nbox:{link.id}"]
        if not dst.bridged:
            out.setdefault(dst.ns, []).append(["-t", "raw", "-A", LOSS_CHAIN, "-i", dst.ifname, *stat])
        else:
            out.setdefault(src.ns, []).append(["-t", "mangle", "-A", LOSS_CHAIN, "-o", src.ifname, *stat])
    return out


def ensure_loss_chains(ns: Namespace) -> None:
    """Create the loss chains in raw PREROUTING and mangle POSTROUTING of ``ns`` (idempotent)."""
    for table, hook in (("raw", "PREROUTING"), ("mangle", "POSTROUTING")):
        if iptables(ns, ["-t", table, "-N", LOSS_CHAIN], check=False).returncode == 0:
            iptables(ns, ["-t", table, "-A", hook, "-j", LOSS_CHAIN])


def apply_loss(ns: Namespace, rules: list[list[str]], link_ids: set[int]) -> None:
    """Replace the loss rules of ``link_ids`` in ``ns`` by ``rules``."""
    ensure_loss_chains(ns)
    for table in ("raw", "mangle"):
        listing = iptables(ns, ["-t", table, "-S", LOSS_CHAIN]).stdout.splitlines()
        for line in listing:
            for lid in link_ids:
                if f'"nbox:{lid}"' in line or f"nbox:{lid} " in line + " ":
                    iptables(ns, ["-t", table, *line.replace("-A", "-D", 1).split()], check=False)
    for r in rules:
        iptables(ns, r)


def mechanisms(shape_by_dir: list[LinkShape], netem: bool, rate_kind: str = "tbf") -> dict[str, str]:
    """Which mechanism realises rate, delay/jitter and loss of a link (both directions together)."""
    rate = max(s.rate for s in shape_by_dir)
    delay = max(max(s.delay, s.jitter) for s in shape_by_dir)
    loss = max(s.loss for s in shape_by_dir)
    kind = rate_kind if rate_kind != "tbf" or rate <= TBF_MAX_RATE else "htb"
    return {
        "rate": kind if rate > 0 else "none",
        "delay": ("netem" if netem else "relay (TCP)") if delay > 0 else "none",
        "loss": ("netem" if netem else "iptables statistic") if loss > 0 else "none",
    }
