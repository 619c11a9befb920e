"""Raw rtnetlink, batched: links, bridges, addresses, routes and rules sent as one burst per namespace.

pyroute2's request path costs about 300 µs a message here, and a 64-node fat-tree needs some
20 000 routes, so the bulk of a cluster's network is packed with ``struct`` and sent as one
netlink batch per namespace (``RtBatch``), every ack checked; pyroute2 is used where messages
are few and rich (tc qdiscs, statistics). Nothing runs ``ip`` or ``tc``.
"""

from __future__ import annotations

import os
import socket
import struct

from .namespace import Namespace

__all__ = ["RtBatch", "RT_TABLE_MAIN"]

RTM_NEWLINK, RTM_NEWADDR, RTM_NEWROUTE, RTM_NEWRULE = 16, 20, 24, 32
NLM_F_REQUEST, NLM_F_ACK, NLM_F_EXCL, NLM_F_CREATE = 1, 4, 0x200, 0x400
NLMSG_ERROR = 2
IFLA_IFNAME, IFLA_MTU, IFLA_MASTER, IFLA_TXQLEN, IFLA_LINKINFO, IFLA_NET_NS_FD = 3, 4, 10, 13, 18, 28
IFLA_INFO_KIND, IFLA_INFO_DATA, VETH_INFO_PEER = 1, 2, 1
IFA_ADDRESS, IFA_LOCAL = 1, 2
RTA_DST, RTA_OIF, RTA_GATEWAY, RTA_PREFSRC, RTA_TABLE = 1, 4, 5, 7, 15
FRA_SRC, FRA_PRIORITY, FRA_TABLE = 2, 6, 15
IFF_UP = 1
RT_TABLE_MAIN = 254
RTPROT_STATIC = 4


def _attr(kind: int, payload: bytes) -> bytes:
    n = 4 + len(payload)
    return struct.pack("=HH", n, kind) + payload + b"\0" * ((4 - n % 4) % 4)


def _ip(addr: str) -> bytes:
    return socket.inet_aton(addr)


def _ifinfo(index: int = 0, flags: int = 0, change: int = 0) -> bytes:
    return struct.pack("=BxHiII", socket.AF_UNSPEC, 0, index, flags, change)


class RtBatch:
    """Queue rtnetlink requests for one namespace and send them together, checking every ack."""

    CHUNK = 256

    def __init__(self, ns: Namespace):
        self.ns = ns
        self.sock = ns.socket(socket.AF_NETLINK, socket.SOCK_RAW, 0)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        self.sock.bind((0, 0))
        self._msgs: list[tuple[int, bytes, str]] = []
        self._seq = 0

    def close(self) -> None:
        """Close the netlink socket."""
        self.sock.close()

    def _add(self, mtype: int, flags: int, body: bytes, what: str) -> None:
        self._seq += 1
        hdr = struct.pack("=IHHII", 16 + len(body), mtype, flags | NLM_F_REQUEST | NLM_F_ACK, self._seq, 0)
        self._msgs.append((self._seq, hdr + body, what))

    # Requests ----------------------------------------------------------------------------
    def veth(self, name: str, index: int, peer: str, peer_index: int, peer_ns_fd: int, txqlen: int = 1000) -> None:
        """Create a veth pair: ``name`` here, ``peer`` in the namespace of ``peer_ns_fd``; fixed ifindexes."""
        peer_msg = _ifinfo(peer_index) + _attr(IFLA_IFNAME, peer.encode() + b"\0") + _attr(
            IFLA_NET_NS_FD, struct.pack("=I", peer_ns_fd)
        ) + _attr(IFLA_TXQLEN, struct.pack("=I", txqlen))
        info = _attr(IFLA_INFO_KIND, b"veth\0") + _attr(IFLA_INFO_DATA, _attr(VETH_INFO_PEER, peer_msg))
        body = _ifinfo(index) + _attr(IFLA_IFNAME, name.encode() + b"\0") + _attr(
            IFLA_TXQLEN, struct.pack("=I", txqlen)
        ) + _attr(IFLA_LINKINFO, info)
        self._add(RTM_NEWLINK, NLM_F_CREATE | NLM_F_EXCL, body, f"veth {name}<->{peer}")

    def bridge(self, name: str, index: int) -> None:
        """Create a bridge (STP off, the kernel's default, so ports forward at once)."""
        body = _ifinfo(index) + _attr(IFLA_IFNAME, name.encode() + b"\0") + _attr(
            IFLA_LINKINFO, _attr(IFLA_INFO_KIND, b"bridge\0")
        )
        self._add(RTM_NEWLINK, NLM_F_CREATE | NLM_F_EXCL, body, f"bridge {name}")

    def up(self, index: int, master: int | None = None) -> None:
        """Set a link up (and enslave it to ``master``)."""
        body = _ifinfo(index, IFF_UP, IFF_UP)
        if master is not None:
            body += _attr(IFLA_MASTER, struct.pack("=I", master))
        self._add(RTM_NEWLINK, 0, body, f"link {index} up")

    def address(self, index: int, addr: str, prefix: int) -> None:
        """Add an IPv4 address to a link."""
        body = struct.pack("=BBBBI", socket.AF_INET, prefix, 0, 0, index) + _attr(IFA_LOCAL, _ip(addr)) + _attr(
            IFA_ADDRESS, _ip(addr)
        )
        self._add(RTM_NEWADDR, NLM_F_CREATE | NLM_F_EXCL, body, f"address {addr}/{prefix}")

    def route(self, dst: str, gateway: str, oif: int, prefsrc: str | None = None, table: int = RT_TABLE_MAIN) -> None:
        """Add ``dst/32 via gateway dev oif [src prefsrc] [table]``."""
        body = struct.pack("=BBBBBBBBI", socket.AF_INET, 32, 0, 0, table if table < 256 else 252, RTPROT_STATIC, 0, 1, 0)
        body += _attr(RTA_DST, _ip(dst)) + _attr(RTA_GATEWAY, _ip(gateway)) + _attr(RTA_OIF, struct.pack("=i", oif))
        if prefsrc:
            body += _attr(RTA_PREFSRC, _ip(prefsrc))
        if table >= 256:
            body += _attr(RTA_TABLE, struct.pack("=I", table))
        self._add(RTM_NEWROUTE, NLM_F_CREATE | NLM_F_EXCL, body, f"route {dst} via {gateway} table {table}")

    def rule(self, src: str, table: int, priority: int) -> None:
        """Add ``from src/32 lookup table`` at ``priority``."""
        body = struct.pack("=BBBBBBBBI", socket.AF_INET, 0, 32, 0, table if table < 256 else 252, 0, 0, 1, 0)
        body += _attr(FRA_SRC, _ip(src)) + _attr(FRA_PRIORITY, struct.pack("=I", priority))
        body += _attr(FRA_TABLE, struct.pack("=I", table))
        self._add(RTM_NEWRULE, NLM_F_CREATE | NLM_F_EXCL, body, f"rule from {src} lookup {table}")

    # Sending -------------------------------------------------------------------------------
    def commit(self) -> int:
        """Send every queued request (in chunks), raise OSError on the first failure; returns the count."""
        msgs, self._msgs = self._msgs, []
        for start in range(0, len(msgs), self.CHUNK):
            chunk = msgs[start : start + self.CHUNK]
            self.sock.send(b"".join(m[1] for m in chunk))
            pending = {m[0]: m[2] for m in chunk}
            while pending:
                data = self.sock.recv(1 << 20)
                off = 0
                while off + 16 <= len(data):
                    length, mtype, _flags, seq, _pid = struct.unpack_from("=IHHII", data, off)
                    if mtype == NLMSG_ERROR:
                        (code,) = struct.unpack_from("=i", data, off + 16)
                        what = pending.pop(seq, None)
                        if code != 0 and what is not None:
                            raise OSError(-code, f"netlink {what} in {self.ns.name}: {os.strerror(-code)}")
                    off += (length + 3) & ~3
        return len(msgs)
