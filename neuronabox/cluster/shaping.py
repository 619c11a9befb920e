"""Link shaping, every tc parameter in one place (Mininet's link.py plays this role there).

Per link direction (the egress qdisc of the sending veth end):

- rate: ``tbf`` (default) or ``htb`` (also used above tbf's 32-bit bytes/s field, 34 Gbit/s);
- delay, jitter: ``netem`` under the rate qdisc when the kernel has it; otherwise the shaping
  agent adds them in user space: its TCP relay (``relay.py``) to TCP streams, its NFQUEUE
  delay line (``nfqueue.py``) to every other packet (ICMP, UDP);
- loss: ``netem`` when present; otherwise an iptables ``statistic`` DROP rule at the link's
  routed end (a bridge port is not seen by iptables, but every link has a routed end: its
  NIC, or both ends of a switch-to-switch link).

``mechanisms()`` says which of these each link uses; ``nbox up`` and ``nbox doctor`` print it.
"""

from __future__ import annotations

import errno
import functools
import shlex
import socket
import struct
import subprocess
from dataclasses import asdict, dataclass

from .namespace import Namespace
from .nfqueue import queue_rule
from .relay import redirect_rule

__all__ = [
    "LinkShape",
    "RateParams",
    "rate_params",
    "kernel_qdiscs",
    "has_netem",
    "apply_rate",
    "delete_root",
    "apply_loss",
    "mechanisms",
    "delay_rules",
    "QDISCS",
]

MTU_FRAME = 1514
GSO_MAX_SIZE = 65536  # the kernel's default gso_max_size: what an unshaped veth keeps
# The qdiscs `nbox doctor` asks the kernel about.
QDISCS = ("netem", "tbf", "htb", "pfifo", "fq", "fq_codel", "sfq", "prio", "cake", "ingress", "clsact")
U32_MAX = (1 << 32) - 1
TBF_MAX_RATE = U32_MAX  # bytes/s: tbf's rate field (pyroute2 sends no TCA_TBF_RATE64)
LOSS_CHAIN = "NBOX_LOSS"
DELAY_USERSPACE = "relay (TCP) + nfqueue (ICMP/UDP)"


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
    gso_max_size: int = GSO_MAX_SIZE  # the largest GSO packet the shaped veth end accepts


def rate_params(rate: float) -> RateParams:
    """Bucket, queue and GSO packet sizes for a rate between 1 Mbit/s and 100 Gbit/s.

    Burst: one timer tick's worth (1 ms, as tc-tbf(8) asks: at least rate/HZ) but never under
    two full frames, or tbf could not pass a frame at low rates. A bucket is a head start: after
    an idle spell (a training step's compute) that many bytes leave at once, which a real link
    serialising at its rate never allows, so it stays short.

    GSO: the kernel hands the qdisc GSO packets of up to ``gso_max_size`` bytes (64 KiB by
    default), cut into MTU frames only when they leave the veth, as a NIC with TSO cuts them in
    hardware after its shaper. tbf passes such a packet whole only if the bucket holds it
    (qdisc_pkt_len: its bytes plus the 66 B of headers each segment repeats); a bigger one it
    cuts itself (tbf_segment) into MTU packets, each counted with its own headers on the veth,
    and the receiver then ACKs every other frame: at 100 Mbit/s (a 12.5 kB bucket) the link
    counters read ~6.5% above the bytes a collective moved, where a real TSO NIC reads ~0.3%.
    A bucket big enough for 64 KiB would fix the counters but give every collective a 5 ms head
    start at 100 Mbit/s. So instead the shaped veth's ``gso_max_size`` is cut to 90% of the
    bucket (TCP keeps ~320 B of it for headers; tbf adds 66 B per segment, 4.6%): GSO packets
    then pass whole, one header and about one ACK per packet, and the bucket keeps its size.
    The rate is unchanged either way, and so is the payload share the models use: tbf charges
    every segment's headers whether or not it cuts the packet.

    Queue: 20 ms of traffic plus the burst, at least ten frames, so that TCP keeps the link
    busy without a bloated queue.
    """
    r = int(rate)
    # Both are 32-bit fields of the kernel: above 34 Tbit/s (units.MAX_BANDWIDTH is 100) they stop at 4 GiB.
    burst = min(U32_MAX, max(2 * MTU_FRAME, int(r * 0.001)))
    limit = min(U32_MAX, burst + max(10 * MTU_FRAME, int(r * 0.020)))
    return RateParams(r, burst, limit, min(GSO_MAX_SIZE, int(burst * 0.9)))


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
            delete_root(ipr, index)
            set_gso_max_size(ipr, index, GSO_MAX_SIZE)
        return "none"
    parent = 0xFFFFFFFF
    if with_netem:
        ipr.tc(cmd, "netem", index, 0x10000, delay=int(shape.delay * 1e6), jitter=int(shape.jitter * 1e6),
               loss=shape.loss * 100, limit=10000)
        parent = 0x10001
        if shape.rate <= 0:
            return "none"
    p = rate_params(shape.rate)
    set_gso_max_size(ipr, index, p.gso_max_size)
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


def set_gso_max_size(ipr, index: int, size: int) -> None:
    """Cap the GSO packets the stack hands to one veth end (see ``rate_params``); connections opened later use it."""
    try:
        ipr.link("set", index=index, gso_max_size=int(size))
    except Exception:  # noqa: BLE001 - a kernel that will not set it: the rate holds, tbf just cuts GSO packets
        pass


def delete_root(ipr, index: int) -> None:
    """Remove a link end's root qdisc (and everything under it); nothing to remove is fine."""
    try:
        # root=True: without a parent pyroute2 0.9 asks for handle 0 and the kernel answers
        # ENOENT, which was taken for "no qdisc" while tbf stayed (a rate of 0 kept limiting).
        ipr.tc("del", index=index, root=True)
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


def restore_text(rules: list[list[str]]) -> str:
    """``iptables-restore --noflush`` input that appends ``rules`` (iptables argument lists with ``-t TABLE -A ...``)."""
    import shlex

    tables: dict[str, list[str]] = {}
    for r in rules:
        table = r[r.index("-t") + 1] if "-t" in r else "filter"
        rest = [a for i, a in enumerate(r) if not (a == "-t" or (i and r[i - 1] == "-t"))]
        tables.setdefault(table, []).append(" ".join(shlex.quote(a) if a != "!" else a for a in rest))
    return "".join(f"*{t}\n" + "".join(line + "\n" for line in lines) + "COMMIT\n" for t, lines in tables.items())


def iptables_restore_parallel(jobs: list[tuple[Namespace, list[list[str]]]], width: int = 8) -> None:
    """Append each job's rules in its namespace with one ``iptables-restore`` per namespace, a few at a time.

    One process per namespace rather than one per rule: a process start costs ~10-20 ms here
    (the preexec_fn that enters the namespace rules out vfork), and 64 nodes each have two rules.
    """
    running: list[tuple[subprocess.Popen, str]] = []

    def reap(p: subprocess.Popen, text: str) -> None:
        _, err = p.communicate()
        if p.returncode != 0:
            raise subprocess.CalledProcessError(p.returncode, ["iptables-restore", "--noflush"], output=text, stderr=err)

    for ns, rules in jobs:
        if len(running) >= width:
            reap(*running.pop(0))
        text = restore_text(rules)
        p = subprocess.Popen(["iptables-restore", "-w", "--noflush"], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True, preexec_fn=ns.preexec())
        p.stdin.write(text)
        p.stdin.close()
        p.stdin = None  # communicate() must not flush a closed pipe
        running.append((p, text))
    for p, text in running:
        reap(p, text)


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
    """Replace the loss rules of ``link_ids`` in ``ns`` by ``rules``; chains left empty go too."""
    left, chains = 0, False
    for table in ("raw", "mangle"):
        # A namespace that never had loss has no chain to list, and nothing to remove.
        listing = iptables(ns, ["-t", table, "-S", LOSS_CHAIN], check=False).stdout.splitlines()
        chains = chains or bool(listing)
        for line in listing:
            if not line.startswith("-A "):
                continue
            if any(f'"nbox:{lid}"' in line or f"nbox:{lid} " in line + " " for lid in link_ids):
                # shlex: iptables -S quotes the comment, and a quote left in would match no rule.
                iptables(ns, ["-t", table, *shlex.split(line.replace("-A", "-D", 1))])
            else:
                left += 1
    if rules:
        ensure_loss_chains(ns)
        for r in rules:
            iptables(ns, r)
    elif chains and not left:
        # No loss in this namespace any more: not even an empty chain on every packet's path.
        for table, hook in (("raw", "PREROUTING"), ("mangle", "POSTROUTING")):
            iptables(ns, ["-t", table, "-D", hook, "-j", LOSS_CHAIN])
            iptables(ns, ["-t", table, "-X", LOSS_CHAIN])


def delay_rules(relay_port: int, subnet: str) -> list[list[str]]:
    """iptables rules that send a node's own traffic into the user-space delay path: TCP to the relay, the rest to the queue."""
    return [redirect_rule(relay_port, subnet), queue_rule(subnet)]


def mechanisms(shape_by_dir: list[LinkShape], netem: bool, rate_kind: str = "tbf") -> dict[str, str]:
    """Which mechanism realises rate, delay/jitter and loss of a link (both directions together)."""
    rate = max(s.rate for s in shape_by_dir)
    delay = max(max(s.delay, s.jitter) for s in shape_by_dir)
    loss = max(s.loss for s in shape_by_dir)
    kind = rate_kind if rate_kind != "tbf" or rate <= TBF_MAX_RATE else "htb"
    return {
        "rate": kind if rate > 0 else "none",
        "delay": ("netem" if netem else DELAY_USERSPACE) if delay > 0 else "none",
        "loss": ("netem" if netem else "iptables statistic") if loss > 0 else "none",
    }
