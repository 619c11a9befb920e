"""The user-space delay path for non-TCP traffic (ICMP, UDP), for kernels without sch_netem.

The TCP relay (``relay.py``) delays streams; packets that are not TCP (a ``ping``, a UDP
probe, an ICMP error) would cross the cluster undelayed. Here an iptables ``NFQUEUE`` rule in
each node namespace (``mangle OUTPUT``, non-TCP to the cluster subnet) hands the node's own
outgoing packets to the shaping agent, which holds each one for its route's one-way delay
(plus jitter) and then gives it an ACCEPT verdict. A ping's request is held by the sender's
queue and its reply by the responder's, so the round trip gains both routes' delays.

Protocol: nfnetlink_queue spoken directly on a ``NETLINK_NETFILTER`` socket made inside the
node's namespace (queues are per namespace, so every node uses the same queue number),
messages built and parsed with pyroute2's netlink classes. Only the first ``COPY_RANGE``
bytes of a packet are copied to user space (the IP and L4 headers: enough for the flow key);
the verdict carries no payload, so the kernel sends the original packet on. The rule has
``--queue-bypass``: while no agent listens (before it starts, after it died) packets pass
undelayed instead of being dropped.

Order: a flow (protocol, destination, ports or ICMP id) never reorders, even with jitter: a
packet is released no earlier than the one ahead of it in its flow. Release times live in
the relay's timer heap (one ``timerfd`` in the agent's event loop), so nothing spins.

Speed: one Python verdict per packet. DESIGN.md measured such a path at about 1 MB/s, which is
why bulk traffic (TCP) goes through the stream relay; ICMP and UDP control traffic (pings,
probes, DNS-sized datagrams) is far below that.
"""

from __future__ import annotations

import errno
import random
import socket
import struct
from typing import Callable

from pyroute2.netlink import NLM_F_ACK, NLM_F_REQUEST, NLMSG_ERROR, nla
from pyroute2.netlink.nfnetlink import NFNL_SUBSYS_QUEUE, nfgen_msg

__all__ = ["NfQueue", "DelayLine", "queue_rule", "QUEUE_NUM", "NETLINK_NETFILTER"]

NETLINK_NETFILTER = 12
SOL_NETLINK, NETLINK_NO_ENOBUFS = 270, 5
QUEUE_NUM = 0x4E42  # the queue every node namespace binds (queues are per namespace)
COPY_RANGE = 128  # IP header (<= 60) + the L4 ports or ICMP id: all the flow key needs
QUEUE_MAXLEN = 4096
NFQNL_MSG_PACKET, NFQNL_MSG_VERDICT, NFQNL_MSG_CONFIG = 0, 1, 2
NFQNL_CFG_CMD_BIND, NFQNL_CFG_CMD_UNBIND = 1, 2
NFQNL_COPY_PACKET = 2
NFQA_CFG_F_GSO = 4  # a GSO packet reaches us whole (we never touch its payload)
NF_ACCEPT = 1
MSG_PACKET = (NFNL_SUBSYS_QUEUE << 8) | NFQNL_MSG_PACKET
MSG_VERDICT = (NFNL_SUBSYS_QUEUE << 8) | NFQNL_MSG_VERDICT
MSG_CONFIG = (NFNL_SUBSYS_QUEUE << 8) | NFQNL_MSG_CONFIG
_HDR = struct.Struct("=IHHII")


class nfqnl_msg(nfgen_msg):
    """An nfnetlink_queue packet or verdict message (linux/netfilter/nfnetlink_queue.h)."""

    nla_map = (
        ("NFQA_UNSPEC", "none"),
        ("NFQA_PACKET_HDR", "packet_hdr"),
        ("NFQA_VERDICT_HDR", "verdict_hdr"),
        ("NFQA_MARK", "be32"),
        ("NFQA_TIMESTAMP", "hex"),
        ("NFQA_IFINDEX_INDEV", "be32"),
        ("NFQA_IFINDEX_OUTDEV", "be32"),
        ("NFQA_IFINDEX_PHYSINDEV", "be32"),
        ("NFQA_IFINDEX_PHYSOUTDEV", "be32"),
        ("NFQA_HWADDR", "hex"),
        ("NFQA_PAYLOAD", "cdata"),
        ("NFQA_CT", "hex"),
        ("NFQA_CT_INFO", "be32"),
        ("NFQA_CAP_LEN", "be32"),
        ("NFQA_SKB_INFO", "be32"),
    )

    class packet_hdr(nla):
        """struct nfqnl_msg_packet_hdr."""

        fields = (("packet_id", ">I"), ("hw_protocol", ">H"), ("hook", "B"))

    class verdict_hdr(nla):
        """struct nfqnl_msg_verdict_hdr."""

        fields = (("verdict", ">I"), ("id", ">I"))


class nfqnl_config(nfgen_msg):
    """An nfnetlink_queue configuration message."""

    nla_map = (
        ("NFQA_CFG_UNSPEC", "none"),
        ("NFQA_CFG_CMD", "cmd"),
        ("NFQA_CFG_PARAMS", "params"),
        ("NFQA_CFG_QUEUE_MAXLEN", "be32"),
        ("NFQA_CFG_MASK", "be32"),
        ("NFQA_CFG_FLAGS", "be32"),
    )

    class cmd(nla):
        """struct nfqnl_msg_config_cmd."""

        fields = (("command", "B"), ("__pad", "x"), ("pf", ">H"))

    class params(nla):
        """struct nfqnl_msg_config_params (packed: 5 bytes)."""

        fields = (("copy_range", ">I"), ("copy_mode", "B"))


def queue_rule(subnet: str, num: int = QUEUE_NUM) -> list[str]:
    """The iptables arguments that queue a node's own non-TCP packets into the cluster to the agent."""
    return ["-t", "mangle", "-A", "OUTPUT", "-d", subnet, "!", "-o", "lo", "!", "-p", "tcp",
            "-j", "NFQUEUE", "--queue-num", str(num), "--queue-bypass"]


class NfQueue:
    """One bound nfnetlink queue in one namespace: packets in (``on_packet``), verdicts out."""

    def __init__(self, ns=None, num: int = QUEUE_NUM):
        self.num = num
        make = (lambda: ns.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)) if ns is not None else (
            lambda: socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER))
        self.sock = make()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        # A full receive buffer drops packets (the kernel counts them); it must not also make
        # every later recv fail with ENOBUFS.
        self.sock.setsockopt(SOL_NETLINK, NETLINK_NO_ENOBUFS, 1)
        self.sock.bind((0, 0))
        self.seq = 0
        self.packets = 0
        self._bind()
        self.sock.setblocking(False)

    def fileno(self) -> int:
        """The netlink socket's fd (for the event loop)."""
        return self.sock.fileno()

    def _config(self, attrs: list) -> None:
        self.seq += 1
        m = nfqnl_config()
        m["header"]["type"] = MSG_CONFIG
        m["header"]["flags"] = NLM_F_REQUEST | NLM_F_ACK
        m["header"]["sequence_number"] = self.seq
        m["nfgen_family"] = socket.AF_UNSPEC
        m["res_id"] = self.num
        m["attrs"] = attrs
        m.encode()
        self.sock.send(bytes(m.data))
        self.sock.settimeout(5)
        data = self.sock.recv(65536)
        length, mtype, _, seq, _ = _HDR.unpack_from(data, 0)
        if mtype == NLMSG_ERROR:
            (code,) = struct.unpack_from("=i", data, 16)
            if code:
                raise OSError(-code, f"nfnetlink_queue {attrs[0][0]} for queue {self.num}: {errno.errorcode.get(-code, -code)}")

    def _bind(self) -> None:
        self._config([("NFQA_CFG_CMD", {"command": NFQNL_CFG_CMD_BIND, "pf": socket.AF_INET})])
        self._config([("NFQA_CFG_PARAMS", {"copy_range": COPY_RANGE, "copy_mode": NFQNL_COPY_PACKET})])
        self._config([("NFQA_CFG_QUEUE_MAXLEN", QUEUE_MAXLEN)])
        self._config([("NFQA_CFG_FLAGS", NFQA_CFG_F_GSO), ("NFQA_CFG_MASK", NFQA_CFG_F_GSO)])

    def read(self) -> list[tuple[int, bytes]]:
        """Every queued packet the socket holds now: (packet id, its first bytes)."""
        out: list[tuple[int, bytes]] = []
        for _ in range(64):  # a bounded batch per wake-up: verdicts must not starve
            try:
                data = self.sock.recv(1 << 16)
            except (BlockingIOError, InterruptedError):
                break
            off = 0
            while off + 16 <= len(data):
                length, mtype, _, _, _ = _HDR.unpack_from(data, off)
                if length < 16:
                    break
                if mtype == MSG_PACKET:
                    m = nfqnl_msg(data[off : off + length])
                    m.decode()
                    hdr = m.get_attr("NFQA_PACKET_HDR")
                    if hdr is not None:
                        out.append((hdr["packet_id"], m.get_attr("NFQA_PAYLOAD") or b""))
                off += (length + 3) & ~3
        self.packets += len(out)
        return out

    def accept(self, ids: list[int]) -> None:
        """ACCEPT verdicts for ``ids``, sent together in one datagram."""
        parts = []
        for pid in ids:
            m = nfqnl_msg()
            m["header"]["type"] = MSG_VERDICT
            m["header"]["flags"] = NLM_F_REQUEST
            m["nfgen_family"] = socket.AF_UNSPEC
            m["res_id"] = self.num
            m["attrs"] = [("NFQA_VERDICT_HDR", {"verdict": NF_ACCEPT, "id": pid})]
            m.encode()
            parts.append(bytes(m.data))
        for start in range(0, len(parts), 256):
            try:
                self.sock.send(b"".join(parts[start : start + 256]))
            except BlockingIOError:
                # The kernel takes verdicts synchronously; a full socket buffer is not expected.
                # Retry once blocking rather than lose a verdict (a lost one holds the packet).
                self.sock.setblocking(True)
                try:
                    self.sock.send(b"".join(parts[start : start + 256]))
                finally:
                    self.sock.setblocking(False)

    def close(self) -> None:
        """Close the socket (the kernel unbinds the queue and drops what it still held, like a link going down)."""
        self.sock.close()


def flow_key(pkt: bytes) -> tuple:
    """What must stay in order: protocol and destination, plus UDP ports or the ICMP echo id."""
    if len(pkt) < 20:
        return ()
    ihl = (pkt[0] & 0x0F) * 4
    proto = pkt[9]
    dst = pkt[16:20]
    l4 = pkt[ihl : ihl + 8]
    if proto in (17, 136) and len(l4) >= 4:  # UDP, UDP-Lite: ports
        return (proto, dst, l4[:4])
    if proto == 1 and len(l4) >= 6:  # ICMP: type and echo id
        return (proto, dst, l4[0], l4[4:6])
    return (proto, dst)


class DelayLine:
    """Non-TCP packets of many namespaces, each held for its route's one-way delay on one event loop."""

    def __init__(self, loop, timers, lookup: Callable[[str, str], object]):
        self.loop = loop
        self.timers = timers  # relay.TimerQueue: absolute release times, one timerfd
        self.lookup = lookup  # (namespace key, destination address) -> Delays (the relay's table)
        self.queues: dict[str, NfQueue] = {}
        self.last: dict[tuple, float] = {}
        self.held = 0
        self.released = 0
        self._due: dict[str, list[int]] = {}

    def attach(self, key: str, ns=None, num: int = QUEUE_NUM) -> None:
        """Bind the queue of namespace ``ns`` and start delaying what it queues."""
        if key in self.queues:
            return
        q = NfQueue(ns, num)
        self.queues[key] = q
        self.loop.add_reader(q.fileno(), self._readable, key, q)

    def _readable(self, key: str, q: NfQueue) -> None:
        now = self.loop.time()
        for pid, pkt in q.read():
            dst = socket.inet_ntoa(pkt[16:20]) if len(pkt) >= 20 else ""
            d = self.lookup(key, dst)
            delay, jitter = d.fwd, d.jitter_fwd
            t = now + delay
            if jitter:
                t += random.uniform(-jitter, jitter)
            flow = (key, *flow_key(pkt))
            t = max(t, self.last.get(flow, 0.0), now)
            self.last[flow] = t
            self.held += 1
            if self.timers.due(t):  # no trip through the timer (as the relay's chunks)
                self._release(key, pid)
            else:
                self.timers.at(t, lambda k=key, p=pid: self._release(k, p))
        if len(self.last) > 4096:
            self.last = {f: t for f, t in self.last.items() if t > now}

    def _release(self, key: str, pid: int) -> None:
        # Verdicts due in the same timer wake-up leave in one datagram per queue.
        due = self._due.get(key)
        if due is None:
            due = self._due[key] = []
            self.loop.call_soon(self._flush, key)
        due.append(pid)

    def _flush(self, key: str) -> None:
        ids = self._due.pop(key, [])
        q = self.queues.get(key)
        if q is not None and ids:
            q.accept(ids)
            self.released += len(ids)

    def close(self) -> None:
        """Unbind every queue (the kernel drops the packets still held; later ones bypass the queue)."""
        for q in self.queues.values():
            self.loop.remove_reader(q.fileno())
            q.close()
        self.queues.clear()
